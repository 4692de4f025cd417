"""Building blocks shared by the model families: norms, MLPs, fused projections and the
attention modules that send every attention call through the backend.

Projections that read the same input are fused into one ``MergedLinear`` (q|k|v for
self-attention, k|v for cross-attention, gate|up for gated MLPs): one GEMM instead of
two or three per layer, which is what decode steps at small batch are bound by.

Tensor parallelism (``tp``, a ``TensorParallelGroup``; size 1 changes nothing): the
projections into a block are column-parallel (each rank computes its own heads or
intermediate units, fused shards split per rank), the projection out of it is
row-parallel (partial sums, one all-reduce per block). ``tp_dims`` tells the loader which
dimension of a checkpoint tensor to slice for this rank.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, LayerKV
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup
from enc2dec.kernels.activations import gated_gelu
from enc2dec.kernels.norms import fused_add_layer_norm, fused_add_rms_norm
from enc2dec.kernels.skinny_gemm import Prologue, skinny_linear

_gelu_tanh = functools.partial(F.gelu, approximate="tanh")

# HF activation names -> functions. gelu_new / gelu_fast are the tanh approximation.
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


# Activations the skinny GEMV can apply to its output (kernels/skinny_gemm.py).
_GEMV_ACTS = {F.relu: "relu", F.gelu: "gelu", _gelu_tanh: "gelu_tanh"}


def get_activation(name: str, option: str = "activation_function"):
    if name not in ACTIVATIONS:
        raise ValueError(f"{option}={name!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _one_row(x: torch.Tensor | Prologue) -> bool:
    shape = x.shape
    return len(shape) >= 1 and shape[-1] > 0 and all(d == 1 for d in shape[:-1])


def clamp_fp16(h: torch.Tensor) -> torch.Tensor:
    """Keep fp16 residual streams finite, as transformers does for T5/BART (no host sync)."""
    if h.dtype != torch.float16:
        return h
    limit = torch.finfo(torch.float16).max - 1000
    return h.clamp(-limit, limit)


class _GemvFusable:
    """A norm whose output only ever feeds one linear layer (or an MLP's first one).
    ``engine/runner/fast_linear.py`` sets ``into_gemv`` where that layer runs the skinny GEMV: a
    one-row call then returns a ``Prologue`` the GEMV computes as it loads its input (one
    launch fewer per norm), and the new residual, which that GEMV writes. Only the models mark such norms
    (``gemv_fed_norms``): a norm whose output is also the residual (post-norm BART) or goes
    elsewhere (final norms) never defers."""

    into_gemv = False
    norm_kind = ""

    def _deferred(self, x: torch.Tensor, residual: torch.Tensor | None):
        pro = Prologue(x, residual, norm=self.norm_kind, norm_weight=self.weight,
                       norm_bias=getattr(self, "bias", None), eps=self.eps)
        return pro, (x if residual is None else pro.res_out)

    def _defers(self, x: torch.Tensor) -> bool:
        return self.into_gemv and x.dtype != torch.float16 and _one_row(x)


class RMSNorm(_GemvFusable, nn.Module):
    """T5's LayerNorm: scale only, no mean subtraction, variance in float32."""

    norm_kind = "rms"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._defers(x):
            return self._deferred(x, None)[0]
        if x.is_cuda:   # one Triton kernel instead of five eager ones (same math, fp32 inside)
            return fused_add_rms_norm(x, None, self.weight, self.eps)[0]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(self.weight.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one kernel on the GPU outside float16, whose
        residual stream needs transformers' clamp between the add and the norm."""
        if self._defers(x):
            return self._deferred(x, residual)
        if x.is_cuda and x.dtype != torch.float16:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        h = clamp_fp16(residual + x)
        return self(h), h


class LayerNorm(_GemvFusable, nn.LayerNorm):
    """nn.LayerNorm (BART, mBART, Whisper) whose residual add can ride in the norm's kernel."""

    norm_kind = "layer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._defers(x):
            return self._deferred(x, None)[0]
        if x.is_cuda:
            return fused_add_layer_norm(x, None, self.weight, self.bias, self.eps)[0]
        return super().forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one kernel on the GPU outside float16, whose
        residual stream needs transformers' clamp between the add and the norm."""
        if self._defers(x):
            return self._deferred(x, residual)
        if x.is_cuda and x.dtype != torch.float16:
            return fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        h = clamp_fp16(residual + x)
        return super().forward(h), h


class MergedLinear(nn.Linear):
    """Several same-shaped projections stacked on the output dim; shard ``i`` is rows
    ``[i * out_per_shard, (i + 1) * out_per_shard)`` (local rows: each rank holds its own
    part of every shard). ``zero_bias_shards`` lists shards whose bias does not exist in
    the checkpoint (Whisper's k_proj): they stay zero. One shard = a column-parallel linear."""

    tp_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_per_shard: int, num_shards: int, bias: bool,
                 zero_bias_shards: tuple[int, ...] = (), tp: TensorParallelGroup = SINGLE):
        super().__init__(in_features, tp.split(out_per_shard, "projection size") * num_shards, bias=bias)
        self.num_shards = num_shards
        self.zero_bias_shards = zero_bias_shards


def column_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE):
    """A projection into a block: output features split across ranks."""
    return MergedLinear(in_features, out_features, 1, bias, tp=tp)


class RowParallelLinear(nn.Linear):
    """A projection out of a block: input features split across ranks, the partial
    products summed with one all-reduce, the bias added once after it."""

    tp_dims = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE):
        super().__init__(tp.split(in_features, "projection size"), out_features, bias=bias)
        self.tp = tp
        self.matmul = F.linear          # the local product; engine/runner/fast_linear.py may swap it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.weight, self.bias)
        y = self.tp.all_reduce_(self.matmul(x, self.weight, None))    # [T, out_features]
        return y if self.bias is None else y + self.bias


class DenseMLP(nn.Module):
    """fc1 -> act -> fc2 (T5 v1.0 relu without bias; BART/Whisper with bias)."""

    def __init__(self, d_model: int, d_ff: int, act: str, bias: bool, option: str = "activation_function",
                 tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.fc1 = column_linear(d_model, d_ff, bias, tp)
        self.fc2 = RowParallelLinear(d_ff, d_model, bias, tp)
        self.act = get_activation(act, option)

    act_into_gemv = False       # set by engine/runner/fast_linear.py where fc1 runs the skinny GEMV

    def forward(self, x: torch.Tensor | Prologue) -> torch.Tensor:
        if self.act_into_gemv and _one_row(x) and self.act in _GEMV_ACTS:     # act in fc1's kernel
            return self.fc2(skinny_linear(x, self.fc1.weight, self.fc1.bias, act=_GEMV_ACTS[self.act]))
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """act(gate(x)) * up(x) -> fc2, gate and up fused (T5 v1.1 / Flan gated-gelu)."""

    def __init__(self, d_model: int, d_ff: int, act: str, option: str = "feed_forward_proj",
                 tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.gate_up = MergedLinear(d_model, d_ff, 2, bias=False, tp=tp)
        self.fc2 = RowParallelLinear(d_ff, d_model, False, tp)
        self.act = get_activation(act, option)

    act_into_gemv = False       # set by engine/runner/fast_linear.py where gate_up runs the skinny GEMV

    def forward(self, x: torch.Tensor | Prologue) -> torch.Tensor:
        if self.act_into_gemv and _one_row(x) and self.act in _GEMV_ACTS:     # act(gate) * up in one kernel
            return self.fc2(skinny_linear(x, self.gate_up.weight, None, act=_GEMV_ACTS[self.act], gated=True))
        gate_up = self.gate_up(x)                                # [T, 2 * d_ff / tp]
        if gate_up.is_cuda and self.act is _gelu_tanh:
            return self.fc2(gated_gelu(gate_up, approximate="tanh"))   # one fused kernel
        gate, up = gate_up.chunk(2, dim=-1)                      # [T, d_ff / tp] each
        return self.fc2(self.act(gate) * up)


class SelfAttention(nn.Module):
    """Self-attention with fused q|k|v. ``encode`` is bidirectional over packed sequences;
    ``decode`` writes the new K/V into the paged cache, then attends causally."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, bias: bool, scale: float,
                 backend, k_bias: bool = True, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.num_heads = tp.split(num_heads, "attention heads")                 # this rank's heads
        self.head_dim, self.scale = head_dim, scale
        self.backend = backend
        inner = num_heads * head_dim
        self.qkv = MergedLinear(d_model, inner, 3, bias, zero_bias_shards=() if k_bias else (1,), tp=tp)
        self.out_proj = RowParallelLinear(inner, d_model, bias, tp)

    def _split_qkv(self, x: torch.Tensor):
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)   # [T, 3, H, D]
        return qkv.unbind(1)                                                      # 3 x [T, H, D]

    def encode(self, x: torch.Tensor, meta: EncoderMetadata, bias_table: torch.Tensor | None = None):
        q, k, v = self._split_qkv(x)
        o = self.backend.encoder_attention(q, k, v, meta, self.scale, bias_table)  # [T, H, D]
        return self.out_proj(o.reshape(x.shape[0], -1))

    store_in_gemv = False       # set by engine/runner/fast_linear.py where qkv runs the skinny GEMV

    def decode(self, x: torch.Tensor | Prologue, meta: DecoderMetadata, kv: LayerKV,
               bias_table: torch.Tensor | None = None):
        if self.store_in_gemv and _one_row(x) and kv.k.is_contiguous() and kv.v.is_contiguous():
            # one kernel projects q|k|v and writes k and v into the cache
            qkv = skinny_linear(x, self.qkv.weight, self.qkv.bias, kv_store=(kv.k, kv.v, meta.slot_mapping))
            q = qkv.view(1, 3, self.num_heads, self.head_dim)[:, 0]
        else:
            q, k, v = self._split_qkv(x)                                          # [N, H, D]
            self.backend.store_kv(k, v, kv.k, kv.v, meta.slot_mapping)
        o = self.backend.self_attention(q, kv.k, kv.v, meta, self.scale, bias_table)
        return self.out_proj(o.reshape(x.shape[0], -1))


class CrossAttention(nn.Module):
    """Decoder attention over the request's encoder K/V, which ``write_kv`` projects once
    (fused k|v) into the cross pool at admission."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, bias: bool, scale: float,
                 backend, k_bias: bool = True, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.num_heads = tp.split(num_heads, "cross-attention heads")           # this rank's heads
        self.head_dim, self.scale = head_dim, scale
        self.backend = backend
        inner = num_heads * head_dim
        self.q_proj = column_linear(d_model, inner, bias, tp)
        self.kv = MergedLinear(d_model, inner, 2, bias, zero_bias_shards=() if k_bias else (0,), tp=tp)
        self.out_proj = RowParallelLinear(inner, d_model, bias, tp)

    def write_kv(self, enc_hidden: torch.Tensor, slot_mapping: torch.Tensor, kv: LayerKV) -> None:
        k, v = self.kv(enc_hidden).view(enc_hidden.shape[0], 2, self.num_heads, self.head_dim).unbind(1)
        self.backend.store_kv(k, v, kv.k, kv.v, slot_mapping)                    # k, v: [T_enc, H, D]

    def forward(self, x: torch.Tensor, meta: DecoderMetadata, kv: LayerKV) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)      # [N, H, D]
        o = self.backend.cross_attention(q, kv.k, kv.v, meta, self.scale)
        return self.out_proj(o.reshape(x.shape[0], -1))
