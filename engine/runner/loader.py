"""Builds a model and fills its weights: from a Hugging Face folder (safetensors or
pytorch_model.bin, sharded or not, streamed tensor by tensor) or, with
``load_format="dummy"``, from a seeded random initialisation that reads no files.

The model is built on the meta device (no memory, no init kernels) in the target dtype,
then materialised once on ``device``, so peak memory is one copy of the weights plus the
one checkpoint tensor being copied.
"""
from __future__ import annotations

import contextlib
import json
import os
import zlib
from typing import Iterator

import torch
from torch import nn

from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.engine.models import get_model_class
from enc2dec.engine.models.layers import RMSNorm

LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0
DUMMY_STD = 0.02

# Preference order: one safetensors index or file, then the .bin equivalents.
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors",
                 "pytorch_model.bin.index.json", "pytorch_model.bin")


def load_model(model_dir_or_config, hf_config=None, backend=None, dtype: torch.dtype = torch.float32,
               device="cpu", load_format: str = "auto", tp: TensorParallelGroup = SINGLE) -> nn.Module:
    """``model_dir_or_config``: a checkpoint folder, or (dummy only) a config / None.
    ``hf_config`` defaults to the folder's config.json or the config passed first.
    With ``tp`` of size > 1 the model is this rank's shard."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; valid: {', '.join(LOAD_FORMATS)}")
    model_dir = None
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        model_dir = os.fspath(model_dir_or_config)
    elif hf_config is None:
        hf_config = model_dir_or_config
    weight_files = None
    if load_format == "auto":
        if model_dir is None:
            raise ValueError("load_format='auto' needs a checkpoint folder; "
                             "use load_format='dummy' for random weights from a config")
        weight_files = find_weight_files(model_dir)        # fail before building a large model
    if hf_config is None:
        if model_dir is None:
            raise ValueError("load_model needs a checkpoint folder or an hf_config")
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(model_dir)
    if backend is None:
        from enc2dec.engine.models.attention import TorchAttentionBackend
        backend = TorchAttentionBackend()

    model_cls = get_model_class(hf_config)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_cls(hf_config, backend, tp)
    model = _materialise(model, device)
    if weight_files is None:
        init_dummy_weights(model)
    else:
        model.load_weights(iter_checkpoint(weight_files))
    return model.eval().requires_grad_(False)


def _materialise(model: nn.Module, device) -> nn.Module:
    """``model.to_empty(device=device)`` without its ``torch.empty_like`` of a meta tensor: that
    goes through torch's Python meta functions, whose first call imports sympy (0.29 s of every
    start-up on the CI machine type)."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def find_weight_files(model_dir: str) -> list[str]:
    """The checkpoint files of a folder, in load order."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"checkpoint folder {model_dir} does not exist")
    for name in _WEIGHT_FILES:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(model_dir, s) for s in shards]
        return [path]
    raise FileNotFoundError(f"no weights found in {model_dir}: expected one of {', '.join(_WEIGHT_FILES)} "
                            "(or pass load_format='dummy' for random weights)")


def iter_checkpoint(weight_files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) one at a time so only one tensor is resident beyond the model."""
    for path in weight_files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint shard {path} listed in the index is missing")
        if path.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> None:
    """Random but sane weights: N(0, std) for matrices and embeddings, ones for norm
    scales, zeros for biases and buffers. Seeded per parameter name, so the same model
    comes out every run and tensor-parallel ranks hold identical replicated weights."""
    gen = None
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if gen is None:
                gen = torch.Generator(device=p.device)
            if isinstance(module, (nn.LayerNorm, RMSNorm)) and pname == "weight":
                p.fill_(1.0)
            elif pname == "bias":
                p.zero_()
            else:
                gen.manual_seed(seed + zlib.crc32(f"{mod_name}.{pname}".encode()))
                p.normal_(0.0, std, generator=gen)
        for b in module.buffers(recurse=False):
            b.zero_()
