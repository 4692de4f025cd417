"""Decode-step projections through the skinny GEMV kernel, applied to a model from outside.

A decoder step at small batch multiplies a few rows by every weight matrix once; there the
library GEMM reaches a fraction of the memory bandwidth, and ``kernels.skinny_linear``
streams the weights instead. ``use_skinny_linear(model)`` gives every plain ``nn.Linear``
and ``MergedLinear`` a subclass whose calls with at most ``DISPATCH_ROWS`` rows take the
kernel, larger ones (batched decode steps, encoder batches, prompt steps) keeping
``F.linear``. ``RowParallelLinear`` keeps its all-reduce: only its local product is
swapped. Other subclasses of ``nn.Linear`` are left alone.

With ``fuse``, three more launches per layer ride in the GEMV on one-row calls
(a flan-t5-large step runs 258 kernels instead of 378, docs/benchmarks.md, run I):
- a pre-norm defers into the projection after it: it returns a ``Prologue`` (residual add +
  norm, computed as the GEMV loads its input; program 0 writes the new residual). Which
  norms may is decided here from the layer structure (``GEMV_FED_NORMS``), not guessed;
- an MLP's activation (gated: ``act(gate) * up``) is the epilogue of its first GEMV;
- decoder self-attention's q|k|v GEMV writes k and v into the paged cache.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.bart import BartDecoderLayer, BartEncoderLayer
from enc2dec.engine.models.layers import (DenseMLP, GatedMLP, LayerNorm, MergedLinear, RMSNorm, RowParallelLinear,
                                          SelfAttention, gelu_tanh)
from enc2dec.engine.models.t5 import T5Layer
from enc2dec.kernels import can_use_triton
from enc2dec.kernels.skinny_gemm import Prologue, skinny_linear      # triton itself loads at the first launch
from enc2dec.kernels.tile_gemm import set_configs_file, tile_linear, tile_linear_supported, tile_pays

logger = logging.getLogger("enc2dec")


# Rows up to which the kernel replaces the library GEMM. Measured on an H200 (docs/benchmarks.md,
# runs F and G): at 1 row it beats cuBLAS (flan-t5-large TPOT 1.2 vs 1.5 ms); at 8 rows it is
# far slower (C=8 TPOT 3.1 ms against 1.8 ms at C=64 without it). 2-7 rows are unmeasured, so
# they stay with the library.
DISPATCH_ROWS = 1

# Norms that may defer into the GEMV after them, per layer class: pre-norms, whose output
# feeds that one projection only. A post-norm layer (BART, ``pre_norm`` False) has none: its
# norms' outputs are also the residual stream. No stack's final norm is listed: its output
# goes to the LM head, or to every layer's cross K/V projection. T5 layers are all pre-norm.
GEMV_FED_NORMS = {
    T5Layer: ("self_attn_norm", "encoder_attn_norm", "mlp_norm"),
    BartEncoderLayer: ("self_attn_layer_norm", "final_layer_norm"),
    BartDecoderLayer: ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"),
}

# Activations the skinny GEMV can apply to its output (kernels/skinny_gemm.py).
_GEMV_ACTS = {F.relu: "relu", F.gelu: "gelu", gelu_tanh: "gelu_tanh"}


# Batched decode products through the tile GEMM kernel instead of cuBLAS where it is the faster
# (``tile_pays``; ``tuning.tile_gemm``, set only with programmatic launch, which it is made for;
# process-wide, as programmatic launch).
_TILE = {"on": False, "norms": False}


def set_tile_gemm(on: bool, configs_file: str = "", norms: bool = False) -> None:
    """Process-wide: the tile GEMM on or off, its measured configurations (``tuning.tile_gemm_configs``),
    and whether batched pre-norms defer into it (``tuning.tile_gemm_norms``)."""
    _TILE["on"], _TILE["norms"] = bool(on), bool(norms)
    set_configs_file(configs_file)


def _one_row(x: torch.Tensor | Prologue) -> bool:
    shape = x.shape
    return len(shape) >= 1 and shape[-1] > 0 and all(d == 1 for d in shape[:-1])


def _rows(x: torch.Tensor | Prologue) -> int:
    return math.prod(x.shape[:-1]) if x.shape[-1] else 0


def _tile_rows(x: torch.Tensor | Prologue, weight: torch.Tensor, fused: bool = False) -> bool:
    # rows whose product the tile kernel takes and runs faster than cuBLAS (on the GPU, or the
    # interpreter); ``fused``: a deferred norm or an activation would ride in it
    if not _TILE["on"]:
        return False
    src = x.x if isinstance(x, Prologue) else x
    rows = _rows(src)
    return tile_pays(rows, *weight.shape, fused or isinstance(x, Prologue)) and \
        tile_linear_supported(rows, weight) and can_use_triton(src, weight)


def linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that sends single-row inputs to the GEMV kernel and, with the tile GEMM on,
    batched decode rows to that kernel; a deferred norm rides in whichever takes it."""
    if _rows(x) <= DISPATCH_ROWS:
        return skinny_linear(x, weight, bias)
    if _tile_rows(x, weight):
        return tile_linear(x, weight, bias)
    return F.linear(x.materialize() if isinstance(x, Prologue) else x, weight, bias)


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor | Prologue) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class SkinnyMergedLinear(MergedLinear):
    def forward(self, x: torch.Tensor | Prologue) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class SkinnyRowParallelLinear(RowParallelLinear):
    def local_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, bias)


_SKINNY_CLASSES = {nn.Linear: SkinnyLinear, MergedLinear: SkinnyMergedLinear,
                   RowParallelLinear: SkinnyRowParallelLinear}


class DeferredNorm:
    """Mixed in before a norm class: a one-row call, or with the tile GEMM and its norms on
    (``tuning.tile_gemm_norms``) a batch of rows it takes (not float16, whose residual stream
    needs transformers' clamp between the add and the norm), returns the norm as a ``Prologue``."""

    def _prologue(self, x: torch.Tensor, residual: torch.Tensor | None) -> Prologue:
        return Prologue(x, residual, norm="rms" if isinstance(self, RMSNorm) else "layer", norm_weight=self.weight,
                        norm_bias=getattr(self, "bias", None), eps=self.eps)

    def _defers(self, x: torch.Tensor) -> bool:
        if x.dtype == torch.float16:
            return False
        # a batch the tile GEMM takes with its norm whatever the projection after it (as [1, K])
        return _one_row(x) or (_TILE["norms"] and _tile_rows(x, self.weight.view(1, -1), fused=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor | Prologue:
        if self._defers(x):
            return self._prologue(x, None)
        return super().forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor):
        if self._defers(x):
            pro = self._prologue(x, residual)
            return pro, pro.res_out
        return super().add_forward(x, residual)


class ActInGemv:
    """Mixed in before ``DenseMLP`` / ``GatedMLP``: on one-row calls the activation (gated:
    ``act(gate) * up``) is the epilogue of the first projection's GEMV, and of its tile GEMM on
    the batched rows that kernel takes."""

    def forward(self, x: torch.Tensor | Prologue) -> torch.Tensor:
        # (the unfused forward hands a deferred norm on to its first projection, whose ``linear`` takes it)
        gated = isinstance(self, GatedMLP)
        first = self.gate_up if gated else self.fc1
        if self.act not in _GEMV_ACTS:
            return super().forward(x)
        if _one_row(x):
            product = skinny_linear
        elif _tile_rows(x, first.weight, fused=True):
            product = tile_linear
        else:
            return super().forward(x)
        return self.fc2(product(x, first.weight, first.bias, act=_GEMV_ACTS[self.act], gated=gated))


class StoreInGemv(SelfAttention):
    """Decoder self-attention whose one-row q|k|v GEMV also writes k and v into the cache."""

    def decode(self, x, meta, kv, bias_table=None):
        # An FP8 pool quantises in the store kernel, which the GEMV epilogue does not do.
        if not (_one_row(x) and kv.scales is None and kv.k.is_contiguous() and kv.v.is_contiguous()):
            return super().decode(x, meta, kv, bias_table)
        qkv = skinny_linear(x, self.qkv.weight, self.qkv.bias, kv_store=(kv.k, kv.v, meta.slot_mapping))
        q = qkv.view(1, 3, self.num_heads, self.head_dim)[:, 0]                  # [1, H, D]
        o = self.backend.self_attention(q, kv.k, kv.v, meta, self.scale, bias_table)
        return self.out_proj(o.reshape(x.shape[0], -1))


@functools.cache
def _mixed(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first (one class per pair, e.g. a deferring Triton norm)."""
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})


def _fused_modules(model: nn.Module):
    """(module, fused class) for every fusion the model's structure allows."""
    for module in model.modules():
        if isinstance(module, (DenseMLP, GatedMLP)) and not isinstance(module, ActInGemv):
            first = module.gate_up if isinstance(module, GatedMLP) else module.fc1
            if type(first) is SkinnyMergedLinear:
                yield module, _mixed(ActInGemv, type(module))
        elif type(module) is SelfAttention and type(module.qkv) is SkinnyMergedLinear:
            yield module, StoreInGemv
        names = GEMV_FED_NORMS.get(type(module), ()) if getattr(module, "pre_norm", True) else ()
        for norm in filter(None, (getattr(module, name, None) for name in names)):
            if isinstance(norm, (RMSNorm, LayerNorm)) and not isinstance(norm, DeferredNorm):
                yield norm, _mixed(DeferredNorm, type(norm))


def use_skinny_linear(model: nn.Module, fuse: bool = True) -> int:
    """Swap the classes of the model's plain linear layers (and, with ``fuse``, of the modules
    whose work rides in their GEMV); returns how many linear layers."""
    count = fused = 0
    for module in model.modules():
        cls = _SKINNY_CLASSES.get(getattr(type(module), "plain_class", type(module)))
        if cls is not None:
            module.__class__ = cls
            count += 1
    for module, cls in list(_fused_modules(model)) if fuse else ():
        module.__class__ = cls
        fused += 1
    logger.info("skinny GEMV kernel on %d linear layers for steps of %d row(s); %d norms, activations "
                "and K/V stores ride in it", count, DISPATCH_ROWS, fused)
    return count


def skinny_linear_enabled(device: torch.device, backend_name: str) -> bool:
    """Where the skinny GEMV runs: CUDA with the triton attention backend."""
    return device.type == "cuda" and backend_name == "triton"
