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

Everything here is the plain math on any device. The GPU kernels (Triton add+norm and
gated-gelu, the one-row skinny GEMV and what rides in it) are applied from outside by
``engine/runner/fast_norms.py`` and ``engine/runner/fast_linear.py``, which give modules a
subclass whose forward calls the kernel.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.attention import DecoderMetadata, EncoderMetadata, LayerKV
from enc2dec.engine.parallel.distributed import SINGLE, TensorParallelGroup

gelu_tanh = functools.partial(F.gelu, approximate="tanh")

# HF activation names -> functions. gelu_new / gelu_fast are the tanh approximation.
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str, option: str = "activation_function"):
    if name not in ACTIVATIONS:
        raise ValueError(f"{option}={name!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def clamp_fp16(h: torch.Tensor) -> torch.Tensor:
    """Keep fp16 residual streams finite, as transformers does for T5/BART (no host sync)."""
    if h.dtype != torch.float16:
        return h
    limit = torch.finfo(torch.float16).max - 1000
    return h.clamp(-limit, limit)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # The same math as below in one dispatch (bit-equal in float32) instead of eight: a CPU
        # decode step runs 2-3 norms per layer, each op a few microseconds of dispatch at one row.
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


class RMSNorm(nn.Module):
    """T5's LayerNorm: scale only, no mean subtraction, variance in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the models hand every residual add to the norm
        after it, so that a fused add+norm kernel can take both (engine/runner/fast_norms.py)."""
        h = clamp_fp16(residual + x)
        return rms_norm(h, self.weight, self.eps), h


class Embedding(nn.Embedding):
    """nn.Embedding without its random init. Every model is built on the meta device and then
    loaded (or given dummy weights), so the init only costs: on a meta tensor ``normal_`` runs
    PyTorch's Python reference, whose first call imports torch._dynamo (1.2 s of every start)."""

    def reset_parameters(self) -> None:
        pass


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (BART, mBART, Whisper) with the residual add of ``RMSNorm.add_forward``."""

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = clamp_fp16(residual + x)
        return F.layer_norm(h, self.normalized_shape, self.weight, self.bias, self.eps), h


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.local_product(x, self.bias)
        y = self.tp.all_reduce_(self.local_product(x, None))    # [T, out_features]
        return y if self.bias is None else y + self.bias

    def local_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class DenseMLP(nn.Module):
    """fc1 -> act -> fc2 (T5 v1.0 relu without bias; BART/Whisper with bias)."""

    def __init__(self, d_model: int, d_ff: int, act: str, bias: bool, option: str = "activation_function",
                 tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.fc1 = column_linear(d_model, d_ff, bias, tp)
        self.fc2 = RowParallelLinear(d_ff, d_model, bias, tp)
        self.act = get_activation(act, option)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """act(gate(x)) * up(x) -> fc2, gate and up fused (T5 v1.1 / Flan gated-gelu)."""

    def __init__(self, d_model: int, d_ff: int, act: str, option: str = "feed_forward_proj",
                 tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.gate_up = MergedLinear(d_model, d_ff, 2, bias=False, tp=tp)
        self.fc2 = RowParallelLinear(d_ff, d_model, False, tp)
        self.act = get_activation(act, option)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)              # [T, d_ff / tp] each
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

    def decode(self, x: torch.Tensor, meta: DecoderMetadata, kv: LayerKV, bias_table: torch.Tensor | None = None):
        q, k, v = self._split_qkv(x)                                              # [N, H, D]
        o = self.backend.self_attention(q, kv.k, kv.v, meta, self.scale, bias_table, kv.scales, new_kv=(k, v))
        return self.out_proj(o.reshape(x.shape[0], -1))


class EncoderSegments:
    """Which sequence each packed encoder position belongs to, worked out on the device (so it
    holds inside an encoder CUDA graph), for centring cross-attention keys per sequence.

    A query's scores against keys ``k_j - m`` differ from those against ``k_j`` by ``q . m``, the
    same for every position j of the sequence, so the softmax over them is unchanged: a
    quantised pool can store the centred keys, whose range is no longer set by the channels
    that are large at every position (the outliers that cost an FP8 key its precision).
    Padding positions (cross slot -1) count for no sequence."""

    def __init__(self, meta):
        t = meta.cross_slot_mapping.shape[0]
        ends = meta.cu_seqlens[1:].to(torch.int64)
        self.num = ends.shape[0]
        self.seg = torch.searchsorted(ends, torch.arange(t, device=ends.device), right=True).clamp(max=self.num - 1)
        self.valid = (meta.cross_slot_mapping >= 0).float()                                   # [T]
        count = torch.zeros(self.num, device=ends.device).index_add_(0, self.seg, self.valid)
        self.inv_count = 1.0 / count.clamp(min=1.0)                                           # [B]

    def center(self, k: torch.Tensor) -> torch.Tensor:
        # k: [T, H, D] -> the same with each sequence's mean key (over its real positions) taken out
        kf = k.float()
        sums = torch.zeros(self.num, *k.shape[1:], device=k.device).index_add_(
            0, self.seg, kf * self.valid[:, None, None])
        return (kf - (sums * self.inv_count[:, None, None])[self.seg]).to(k.dtype)


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

    def write_kv(self, enc_hidden: torch.Tensor, slot_mapping: torch.Tensor, kv: LayerKV,
                 segments: "EncoderSegments | None" = None) -> None:
        k, v = self.kv(enc_hidden).view(enc_hidden.shape[0], 2, self.num_heads, self.head_dim).unbind(1)
        if segments is not None:
            k = segments.center(k)
        self.backend.store_kv(k, v, kv.k, kv.v, slot_mapping, kv.scales)         # k, v: [T_enc, H, D]

    def forward(self, x: torch.Tensor, meta: DecoderMetadata, kv: LayerKV) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)      # [N, H, D]
        o = self.backend.cross_attention(q, kv.k, kv.v, meta, self.scale, kv.scales)
        return self.out_proj(o.reshape(x.shape[0], -1))
