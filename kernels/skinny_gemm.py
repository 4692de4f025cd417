"""``y = x @ W.T + b`` for skinny ``x`` (a decode step's few rows): a weight-streaming GEMV.

At batch 1-8 a decoder step is bound by reading the weights once; the library GEMMs pick
tensor-core tiles made for larger M and reach a fraction of the memory bandwidth there.
This kernel gives each program ``BLOCK_N`` output features and streams their weight rows
``[BLOCK_N, K]`` once, multiplying every one of the ``M <= 16`` input rows against them in
fp32 (a broadcast multiply-reduce, no tensor cores: the work is memory-bound). Many small
programs (N / BLOCK_N of them) keep every SM reading.

Used from outside the models (``engine/runner/fast_linear.py`` swaps plain ``nn.Linear`` forwards
on the GPU); larger M goes to ``F.linear``.

Fusions for a decode step's one-row calls, each a launch saved without changing what is
multiplied (every fused value is rounded to the activation dtype as the separate kernel's
output would be):
- the input may be a ``Prologue``, a residual add + RMSNorm/LayerNorm done as each program
  loads its input row (each first reads the row once for its statistics; program 0 also
  writes the new residual);
- ``act`` applies an activation to the output, and ``gated`` pairs weight rows ``n`` and
  ``N + n`` so the gate|up projection and ``act(gate) * up`` are one kernel;
- ``kv_store`` writes the k and v thirds of a q|k|v projection into the paged caches.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import (fused_add_layer_norm_ref, fused_add_rms_norm_ref, gated_gelu_ref, gelu_ref,
                        skinny_linear_ref, store_kv_ref)

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

MAX_ROWS = 16


@lazy_jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, nb_ptr, res_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps, kv_width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, NORM_BIAS: tl.constexpr, STATS_BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, STORE_KV: tl.constexpr, PDL: tl.constexpr,
):
    # Prologue, NORM: 0 none, 1 RMSNorm, 2 LayerNorm of x (+ residual with HAS_RES).
    # Epilogue, ACT: 0 none, 1 gelu (erf), 2 gelu (tanh), 3 relu of the output; GATED: weight
    # rows [N, 2N) are the "up" half, out[:, n] = act(x . w[n]) * (x . w[N + n]).
    # STORE_KV: the output is q|k|v, kv_width wide each; k and v also go to the paged caches
    # (contiguous [blocks, tokens_per_block, heads, head_dim]) at each row's slot (< 0: nowhere).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                         # [BN]
    offs_m = tl.arange(0, BLOCK_M)                                         # [BM]
    mask_n = offs_n < N
    mask_m = offs_m < M
    if PDL:
        # Launched while the kernel before it finishes: no earlier kernel writes the weights, so
        # this program's weight rows start moving into L2 (one prefetch per 128-byte line) before
        # it waits for that kernel's memory, and its loop then reads them from there.
        _prefetch_rows(w_ptr, offs_n, mask_n, stride_wn, K, BLOCK_K)
        if GATED:
            _prefetch_rows(w_ptr + N.to(tl.int64) * stride_wn, offs_n, mask_n, stride_wn, K, BLOCK_K)
        wait_for_previous_kernel()      # before any activation load
    act_dtype = out_ptr.dtype.element_ty
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM != 0:
        # Row statistics first, the whole row in one load when it fits STATS_BLOCK (one memory
        # round trip before the weights stream), else over STATS_BLOCK-wide pieces.
        s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, STATS_BLOCK):
            offs_s = k0 + tl.arange(0, STATS_BLOCK)
            ms = mask_m[:, None] & (offs_s < K)[None, :]
            h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_s[None, :], mask=ms, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_s[None, :], mask=ms, other=0.0)
                h = (h + r.to(tl.float32)).to(act_dtype).to(tl.float32)
            s1 += tl.sum(h, axis=1)
            if NORM == 2 and ONE_PASS:            # whole row at hand: centred variance, as the norm kernel
                c = tl.where(ms, h - (s1 / K)[:, None], 0.0)
                s2 = tl.sum(c * c, axis=1)
            else:
                s2 += tl.sum(h * h, axis=1)
        if NORM == 1:
            rstd = tl.rsqrt(s2 / K + eps)
        else:
            mean = s1 / K
            if ONE_PASS:
                rstd = tl.rsqrt(s2 / K + eps)
            else:
                rstd = tl.rsqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                                # [BK]
        mask_k = offs_k < K
        mk = mask_m[:, None] & mask_k[None, :]
        w_offs = offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        mw = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + w_offs, mask=mw, other=0.0).to(tl.float32)                  # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
        if NORM != 0:
            if HAS_RES:
                r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mk, other=0.0)
                h = (x + r.to(tl.float32)).to(act_dtype)
                tl.store(res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], h, mask=mk & (pid == 0))
                x = h.to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if NORM_BIAS:
                x = x + tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            x = x.to(act_dtype).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)                # [BM, BN]
        if GATED:
            w_up = tl.load(w_ptr + N.to(tl.int64) * stride_wn + w_offs, mask=mw, other=0.0).to(tl.float32)
            acc_up += tl.sum(x[:, None, :] * w_up[None, :, :], axis=2)
    acc = _epilogue(acc, acc_up, b_ptr, offs_n, mask_n, N, act_dtype, HAS_BIAS, ACT, GATED)
    out = acc.to(out_ptr.dtype.element_ty)
    mo = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mo)
    if STORE_KV:
        slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)             # [BM]
        dst = slot[:, None] * kv_width + (offs_n % kv_width)[None, :]
        live = mo & (slot >= 0)[:, None]
        is_k = (offs_n >= kv_width) & (offs_n < 2 * kv_width)
        tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty), mask=live & is_k[None, :])
        tl.store(v_cache_ptr + dst, out.to(v_cache_ptr.dtype.element_ty), mask=live & (offs_n >= 2 * kv_width)[None, :])


@lazy_jit.helper
def _epilogue(acc, acc_up, b_ptr, offs_n, mask_n, N, act_dtype, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              GATED: tl.constexpr):
    # the bias (GATED: the "up" half's from b[N:]), then ACT (1 gelu erf, 2 gelu tanh, 3 relu) of
    # the product rounded to the activation dtype, as the separate activation kernel reads it;
    # GATED: times the rounded "up" product
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        return acc
    g = acc.to(act_dtype).to(tl.float32)
    if ACT == 1:
        g = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh_abs = (1.0 - e) / (1.0 + e)
        g = 0.5 * g * (1.0 + tl.where(u >= 0, tanh_abs, -tanh_abs))
    else:
        g = tl.maximum(g, 0.0)
    if GATED:
        g = g * acc_up.to(act_dtype).to(tl.float32)
    return g


@lazy_jit.helper
def _prefetch_rows(w_ptr, offs_n, mask_n, stride_wn, K, BLOCK_K: tl.constexpr):
    # prefetch.global.L2 of rows offs_n of a row-major bf16/fp16/fp32 weight, 64 elements apart
    # (one 128-byte line of a 2-byte dtype; a 4-byte one is asked for every other line, which L2's
    # sector fills of neighbouring lines cover in part)
    lines = tl.arange(0, max(BLOCK_K // 64, 1)) * 64                       # [BK / 64], at least one line
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + lines
        ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        ok = mask_n[:, None] & (offs_k < K)[None, :]
        tl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l,b", [ptrs, ok],
                                  dtype=tl.int32, is_pure=False, pack=1)


ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@dataclasses.dataclass
class Prologue:
    """A GEMV input still to be computed: ``norm(x + residual)`` (``norm`` "rms" or "layer";
    ``residual`` optional, and then ``res_out`` receives ``x + residual``, the new residual
    stream). ``skinny_linear`` fuses it into the product; ``materialize()`` computes it alone."""

    x: torch.Tensor
    residual: torch.Tensor | None = None
    norm: str = "rms"
    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    eps: float = 1e-6
    res_out: torch.Tensor | None = None

    def __post_init__(self):
        assert self.norm in ("rms", "layer"), f"unsupported norm {self.norm!r}"
        if self.residual is not None and self.res_out is None:
            self.res_out = torch.empty_like(self.residual)

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def materialize(self) -> torch.Tensor:
        """The input tensor itself, by the torch references (fills ``res_out``)."""
        if self.norm == "rms":
            out, new_res = fused_add_rms_norm_ref(self.x, self.residual, self.norm_weight, self.eps)
        else:
            out, new_res = fused_add_layer_norm_ref(self.x, self.residual, self.norm_weight, self.norm_bias, self.eps)
        if self.res_out is not None:
            self.res_out.copy_(new_res)
        return out


class InputArgs(NamedTuple):
    """A product's input as its kernel's arguments: the rows ``x`` (2-D, unit stride), and for a
    ``Prologue`` its residual, the new residual's buffer, the norm (0 none, 1 RMS, 2 Layer)
    with its weight, bias and eps (placeholders where absent)."""

    x: torch.Tensor
    res: torch.Tensor
    res_out: torch.Tensor
    norm: int
    nw: torch.Tensor
    nb: torch.Tensor
    eps: float
    has_res: bool
    norm_bias: bool


def input_args(x: torch.Tensor | Prologue, rows: int, k: int, weight: torch.Tensor) -> InputArgs:
    pro = x if isinstance(x, Prologue) else None
    x2 = (pro.x if pro is not None else x).reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if pro is None:
        return InputArgs(x2, x2, x2, 0, weight, weight, 0.0, False, False)
    res = res_out = x2
    if pro.residual is not None:
        res = pro.residual.reshape(rows, k).contiguous()
        res_out = pro.res_out.view(rows, k)
    nb = pro.norm_bias if pro.norm_bias is not None else weight
    return InputArgs(x2, res, res_out, 1 if pro.norm == "rms" else 2, pro.norm_weight, nb, float(pro.eps),
                     pro.residual is not None, pro.norm_bias is not None)


def activation_ref(y: torch.Tensor, act: str | None, gated: bool) -> torch.Tensor:
    """What the GEMV's activation epilogue computes from the plain product ``y`` [..., N or 2N]."""
    if act is None:
        return y
    if act == "relu":
        n = y.shape[-1] // 2 if gated else y.shape[-1]
        a = torch.relu(y[..., :n].float())
        return (a * y[..., n:].float() if gated else a).to(y.dtype)
    approximate = "tanh" if act == "gelu_tanh" else "none"
    return gated_gelu_ref(y, approximate) if gated else gelu_ref(y, approximate)


def launch_config(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an ``[rows, k] x [n, k]^T`` product.

    Single rows: one warp per program streaming long K runs, narrower programs (more of
    them) for narrow outputs: on an H200 this is the fastest configuration the tuning script
    (bench/scripts/tune_skinny.py) found for flan-t5-large's six shapes and its LM head, and
    faster than cuBLAS for them (figures in docs/benchmarks.md)."""
    if rows == 1:
        if n <= 1536:
            return (1 if k > 2048 else 2), 1024, 1
        return 4, 512, 1
    block_m = max(1, 1 << (rows - 1).bit_length())
    block_n = 8 if n >= 4096 else 4
    block_k = 512 if block_m <= 2 else 256 if block_m <= 8 else 128
    return block_n, block_k, 4


def skinny_linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  act: str | None = None, gated: bool = False, kv_store: tuple | None = None,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` with at most ``MAX_ROWS`` rows;
    ``weight [N, K]`` row-major. ``x`` may be a ``Prologue`` (a norm computed on the fly);
    ``act`` ("gelu", "gelu_tanh", "relu") is applied to the product, and with ``gated`` the
    weight's two halves give ``act(x W1^T) * (x W2^T)`` [..., N / 2]. ``kv_store`` =
    ``(k_cache, v_cache, slot_mapping)`` for a fused q|k|v projection: its k and v thirds are
    also written to the caches, as ``store_kv`` would. More rows (or no Triton) fall back to
    the references. ``block_n``/``block_k``/``num_warps`` override
    ``launch_config`` (bench/scripts/tune_skinny.py)."""
    pro = x if isinstance(x, Prologue) else None
    src = pro.x if pro is not None else x
    rows = src.numel() // src.shape[-1] if src.shape[-1] else 0
    if rows > MAX_ROWS or rows == 0 or not can_use_triton(src, weight) or weight.stride(-1) != 1:
        y = activation_ref(skinny_linear_ref(pro.materialize() if pro is not None else x, weight, bias), act, gated)
        if kv_store is not None:
            q, k, v = y.reshape(-1, 3, y.shape[-1] // 3).unbind(1)
            k_cache, v_cache, slots = kv_store
            store_kv_ref(k.reshape(-1, *k_cache.shape[2:]), v.reshape(-1, *v_cache.shape[2:]), k_cache, v_cache, slots)
        return y
    n, k = weight.shape
    if gated:
        assert n % 2 == 0, f"a gated product needs an even number of weight rows, got {n}"
        n //= 2
    inputs = input_args(x, rows, k, weight)
    x2, res, res_out = inputs.x, inputs.res, inputs.res_out
    out = torch.empty((rows, n), dtype=src.dtype, device=src.device)
    block_m = max(1, 1 << (rows - 1).bit_length())
    default_n, default_k, default_warps = launch_config(rows, n, k)
    block_n, block_k, num_warps = block_n or default_n, block_k or default_k, num_warps or default_warps
    grid = ((n + block_n - 1) // block_n,)
    norm = inputs.norm
    stats = min(1 << (k - 1).bit_length(), 4096 // block_m) if norm else 1
    k_cache = v_cache = slots = weight
    kv_width = 0
    if kv_store is not None:
        k_cache, v_cache, slots = kv_store
        kv_width = n // 3
        assert n % 3 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous() and \
            k_cache[0, 0].numel() == kv_width, "kv_store needs a q|k|v output and contiguous caches of its width"
    _skinny_gemm_kernel[grid](x2, weight, bias if bias is not None else weight, out, res, inputs.nw, inputs.nb, res_out,
                              k_cache, v_cache, slots,
                              rows, n, k, x2.stride(0), weight.stride(0), out.stride(0), res.stride(0),
                              res_out.stride(0), inputs.eps, kv_width,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                              NORM=norm, HAS_RES=inputs.has_res, NORM_BIAS=inputs.norm_bias, STATS_BLOCK=stats,
                              ONE_PASS=stats >= k,
                              ACT=ACTIVATIONS[act], GATED=gated, STORE_KV=kv_store is not None,
                              num_warps=num_warps, **launch_options(x2))
    return out.view(*src.shape[:-1], n)
