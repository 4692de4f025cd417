"""What every encoder-decoder model shares: the LM head (tied or not), cross-K/V writing
and loading Hugging Face checkpoint tensors by name into fused parameters.

A family subclass builds ``self.embed_tokens`` (the decoder's input embedding, which a
tied LM head reuses), ``self.decoder.layers`` (each with an ``encoder_attn``
CrossAttention) and lists its checkpoint-name rules in ``weight_rules``.

Under tensor parallelism (``self.tp``) every rank reads the full checkpoint tensors and
keeps its slice, along the dimension the owning module names in ``tp_dims``; embeddings,
norms and the LM head have none and are replicated.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.attention import EncoderMetadata, KVCache
from enc2dec.engine.parallel.distributed import SINGLE
from enc2dec.engine.models.layers import EncoderSegments, MergedLinear

logger = logging.getLogger("enc2dec")

# A rule: (regex over the checkpoint name, replacement template or None to skip the
# tensor, {value of the group named "s": shard index} or None for an unfused parameter).
WeightRule = tuple[str, str | None, dict[str, int] | None]

EMBEDDING_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


class EncoderDecoderLM(nn.Module):
    """Base class. Subclasses set the KV-cache geometry in ``__init__``:

    ``num_decoder_layers``, ``num_decoder_heads``, ``decoder_head_dim`` (cache allocation),
    ``max_decoder_positions`` (None when positions are relative) and
    ``max_encoder_positions`` (None when unbounded).
    """

    weight_rules: list[WeightRule] = []
    tp = SINGLE                      # a subclass built with a TensorParallelGroup sets its own
    # A tensor the checkpoint may omit, filled with zeros when absent (BART's final_logits_bias).
    optional_zero_tensors: tuple[str, ...] = ()
    # (hidden, weight) -> logits; engine/models/cpu_linear.py swaps in a packed CPU product.
    head_product = staticmethod(F.linear)

    num_decoder_layers: int
    num_decoder_heads: int
    decoder_head_dim: int
    max_decoder_positions: int | None = None
    max_encoder_positions: int | None = None

    def _init_lm_head(self, vocab_size: int, d_model: int, tied: bool, logits_scale: float = 1.0):
        """A tied head reuses ``embed_tokens.weight``; an untied one is allocated and is tied
        anyway when the checkpoint lacks ``lm_head.weight`` (transformers does the same)."""
        self.lm_head = None if tied else nn.Linear(d_model, vocab_size, bias=False)
        self.logits_scale = logits_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, d_model] -> [S, vocab] float32
        if self.logits_scale != 1.0:
            hidden = hidden * self.logits_scale
        weight = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        logits = self.head_product(hidden, weight)
        bias = getattr(self, "final_logits_bias", None)        # [1, vocab] (BART) or absent
        if bias is not None:
            logits = logits + bias
        return logits.float()

    def write_cross_kv(self, enc_hidden: torch.Tensor, meta: EncoderMetadata, kv: KVCache) -> None:
        # enc_hidden: [num_enc_tokens, d_model]; each decoder layer projects its own K/V.
        # FP8 pools store keys centred per sequence (their mean over its positions taken out),
        # which leaves every softmax as it was and spends e4m3's few bits on what differs.
        segments = EncoderSegments(meta) if kv.cross_kv and kv.cross_kv[0].scales is not None else None
        for layer, layer_kv in zip(self.decoder.layers, kv.cross_kv):
            layer.encoder_attn.write_kv(enc_hidden, meta.cross_slot_mapping, layer_kv, segments)

    # ---- checkpoint loading -------------------------------------------------------------

    def map_weight_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """Checkpoint name -> (our parameter name, shard or None); None skips the tensor."""
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name in EMBEDDING_NAMES:
            return "embed_tokens.weight", None
        for pattern, template, shards in self._compiled_rules():
            m = pattern.fullmatch(name)
            if m:
                if template is None:
                    return None
                return m.expand(template), (shards[m["s"]] if shards else None)
        return name, None

    @classmethod
    def _compiled_rules(cls):
        if "_rules_cache" not in cls.__dict__:
            cls._rules_cache = [(re.compile(p), t, s) for p, t, s in cls.weight_rules]
        return cls._rules_cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v, k/v and gate/up; raise when any of
        our parameters got no value. Unknown checkpoint tensors are skipped with a warning."""
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            target = self.map_weight_name(hf_name)
            if target is None:
                continue
            name, shard = target
            if name == "lm_head.weight" and self.lm_head is None:
                # Checkpoint carries its own head although the config says tied: honour it.
                emb = self.embed_tokens.weight
                self.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device=emb.device, dtype=emb.dtype)
            dst = self._tensor_by_name(name)
            if dst is None:
                logger.warning("checkpoint tensor %s (-> %s) is not used by %s", hf_name, name, type(self).__name__)
                continue
            tp_dim = self._tp_dim(name)
            if tp_dim is not None:
                tensor = self.tp.narrow(tensor, tp_dim)                  # this rank's heads / units
            if shard is not None:
                dst = dst.narrow(0, shard * tensor.shape[0], tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)} (does config.json match the weights?)")
            dst.copy_(tensor)
            loaded.add((name, shard or 0))
        self._finish_loading(loaded)

    def _tensor_by_name(self, name: str) -> torch.Tensor | None:
        module_name, _, attr = name.rpartition(".")
        try:
            module = self.get_submodule(module_name) if module_name else self
        except AttributeError:
            return None
        t = getattr(module, attr, None)
        return t if isinstance(t, torch.Tensor) else None

    def _tp_dim(self, name: str) -> int | None:
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name) if module_name else self
        return getattr(module, "tp_dims", {}).get(attr)

    def _finish_loading(self, loaded: set[tuple[str, int]]) -> None:
        if self.lm_head is not None and ("lm_head.weight", 0) not in loaded:
            self.lm_head = None                     # no head in the checkpoint: tie to the embedding
        for name in self.optional_zero_tensors:
            if (name, 0) not in loaded:
                self._tensor_by_name(name).zero_()
                loaded.add((name, 0))
        missing = []
        for mod_name, module in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            num_shards = module.num_shards if isinstance(module, MergedLinear) else 1
            for pname, param in module.named_parameters(recurse=False):
                for s in range(num_shards):
                    if (prefix + pname, s) in loaded:
                        continue
                    if pname == "bias" and s in getattr(module, "zero_bias_shards", ()):
                        size = param.shape[0] // num_shards
                        param.narrow(0, s * size, size).zero_()
                    else:
                        missing.append(prefix + pname + (f"[shard {s}]" if num_shards > 1 else ""))
        if missing:
            raise ValueError(f"the checkpoint has no weights for {len(missing)} parameters of "
                             f"{type(self).__name__}, e.g. {', '.join(missing[:8])} "
                             "(is it a complete checkpoint of the architecture config.json names?)")

