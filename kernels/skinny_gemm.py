"""``y = x @ W.T + b`` for skinny ``x`` (a decode step's few rows): a weight-streaming GEMV.

At batch 1-8 a decoder step is bound by reading the weights once; the library GEMMs pick
tensor-core tiles made for larger M and reach a fraction of the memory bandwidth there.
This kernel gives each program ``BLOCK_N`` output features and streams their weight rows
``[BLOCK_N, K]`` once, multiplying every one of the ``M <= 16`` input rows against them in
fp32 (a broadcast multiply-reduce, no tensor cores: the work is memory-bound). Many small
programs (N / BLOCK_N of them) keep every SM reading.

Used from outside the models (``engine/fast_linear.py`` swaps plain ``nn.Linear`` forwards
on the GPU); larger M goes to ``F.linear``.

The input may be a ``Prologue``: the elementwise step that would have produced it, done on
the fly as each program loads its input row. Either a residual add + RMSNorm/LayerNorm (the
program first reads the whole row for its statistics; program 0 also writes the new
residual) or an activation, optionally gated (``act(x[:, :K]) * x[:, K:]``). Each
transformed value is rounded to the activation dtype before the dot product, as the
separate kernel's output would be, so the fusion saves a launch per norm and activation of
a decode step without changing what is multiplied.
"""
from __future__ import annotations

import dataclasses

import torch

from . import can_use_triton, lazy_jit
from .reference import (fused_add_layer_norm_ref, fused_add_rms_norm_ref, gated_gelu_ref, gelu_ref,
                        skinny_linear_ref)

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

MAX_ROWS = 16


@lazy_jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, nb_ptr, res_out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, NORM_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
):
    # NORM: 0 none, 1 RMSNorm, 2 LayerNorm of x (+ residual with HAS_RES);
    # ACT: 0 none, 1 gelu (erf), 2 gelu (tanh), 3 relu, of x[:, :K] (times x[:, K:] with GATED).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                         # [BN]
    offs_m = tl.arange(0, BLOCK_M)                                         # [BM]
    mask_n = offs_n < N
    mask_m = offs_m < M
    act_dtype = out_ptr.dtype.element_ty
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM != 0:                 # row statistics first (the row is small and stays in cache)
        s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = mask_m[:, None] & (offs_k < K)[None, :]
            h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mk, other=0.0)
                h = (h + r.to(tl.float32)).to(act_dtype).to(tl.float32)
            if NORM == 1:
                s1 += tl.sum(h * h, axis=1)
            else:
                s1 += tl.sum(h, axis=1)
        if NORM == 1:
            rstd = tl.rsqrt(s1 / K + eps)
        else:
            mean = s1 / K
            s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mk = mask_m[:, None] & (offs_k < K)[None, :]
                h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
                if HAS_RES:
                    r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mk, other=0.0)
                    h = (h + r.to(tl.float32)).to(act_dtype).to(tl.float32)
                c = tl.where(mk, h - mean[:, None], 0.0)
                s2 += tl.sum(c * c, axis=1)
            rstd = tl.rsqrt(s2 / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                                # [BK]
        mask_k = offs_k < K
        mk = mask_m[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)    # [BN, BK]
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
        if ACT != 0:
            if ACT == 1:
                x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
            elif ACT == 2:
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                e = tl.exp(-2.0 * tl.abs(u))
                tanh_abs = (1.0 - e) / (1.0 + e)
                x = 0.5 * x * (1.0 + tl.where(u >= 0, tanh_abs, -tanh_abs))
            else:
                x = tl.maximum(x, 0.0)
            if GATED:
                up = tl.load(x_ptr + offs_m[:, None] * stride_xm + K + offs_k[None, :], mask=mk, other=0.0)
                x = x * up.to(tl.float32)
            x = x.to(act_dtype).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)                # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


_ACTS = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@dataclasses.dataclass
class Prologue:
    """A GEMV input still to be computed from ``x``: ``norm(x + residual)`` (``norm`` "rms" or
    "layer"; ``residual`` optional, and then ``res_out`` receives ``x + residual``, the new
    residual stream) or ``act(x)`` / ``act(x[..., :K]) * x[..., K:]`` (``gated``).
    ``skinny_linear`` fuses it into the product; ``materialize()`` computes it on its own."""

    x: torch.Tensor
    residual: torch.Tensor | None = None
    norm: str | None = None
    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    eps: float = 1e-6
    act: str | None = None
    gated: bool = False
    res_out: torch.Tensor | None = None

    def __post_init__(self):
        assert (self.norm is None) != (self.act is None), "a prologue is either a norm or an activation"
        assert self.act in _ACTS, f"unsupported activation {self.act!r}"
        if self.residual is not None and self.res_out is None:
            self.res_out = torch.empty_like(self.residual)

    @property
    def shape(self) -> torch.Size:
        k = self.x.shape[-1] // 2 if self.gated else self.x.shape[-1]
        return torch.Size((*self.x.shape[:-1], k))

    def materialize(self) -> torch.Tensor:
        """The input tensor itself, by the torch references (fills ``res_out``)."""
        if self.norm is not None:
            fn = fused_add_rms_norm_ref if self.norm == "rms" else (
                lambda x, r, w, eps: fused_add_layer_norm_ref(x, r, w, self.norm_bias, eps))
            out, new_res = fn(self.x, self.residual, self.norm_weight, self.eps)
            if self.res_out is not None:
                self.res_out.copy_(new_res)
            return out
        if self.act == "relu":
            y = torch.relu(self.x[..., :self.shape[-1]].float())
            return (y * self.x[..., self.shape[-1]:].float() if self.gated else y).to(self.x.dtype)
        approximate = "tanh" if self.act == "gelu_tanh" else "none"
        return gated_gelu_ref(self.x, approximate) if self.gated else gelu_ref(self.x, approximate)


def launch_config(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an ``[rows, k] x [n, k]^T`` product.

    Single rows: one warp per program streaming long K runs, narrower programs (more of
    them) for narrow outputs. Chosen from bench/tune_skinny.py on an H200 (docs/benchmarks.md,
    run H): per call, flan-t5-large's six shapes and LM head 35.8 us against 44.8 us with the
    earlier (4 or 8, 512, 4 warps) and 41.8 us with cuBLAS."""
    if rows == 1:
        if n <= 1536:
            return (1 if k > 2048 else 2), 1024, 1
        return 4, 512, 1
    block_m = max(1, 1 << (rows - 1).bit_length())
    block_n = 8 if n >= 4096 else 4
    block_k = 512 if block_m <= 2 else 256 if block_m <= 8 else 128
    return block_n, block_k, 4


def skinny_linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` with at most ``MAX_ROWS`` rows;
    ``weight [N, K]`` row-major. More rows (or no Triton) fall back to ``F.linear`` (a
    ``Prologue`` is then materialized first). ``block_n``/``block_k``/``num_warps`` override
    ``launch_config`` (bench/tune_skinny.py)."""
    pro = x if isinstance(x, Prologue) else None
    src = pro.x if pro is not None else x
    shape = x.shape
    rows = src.numel() // src.shape[-1] if src.shape[-1] else 0
    if rows > MAX_ROWS or rows == 0 or not can_use_triton(src, weight) or weight.stride(-1) != 1:
        return skinny_linear_ref(pro.materialize() if pro is not None else x, weight, bias)
    n, k = weight.shape
    x2 = src.reshape(rows, src.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res = res_out = x2
    if pro is not None and pro.residual is not None:
        res = pro.residual.reshape(rows, k).contiguous()
        res_out = pro.res_out.view(rows, k)
    out = torch.empty((rows, n), dtype=src.dtype, device=src.device)
    block_m = max(1, 1 << (rows - 1).bit_length())
    default_n, default_k, default_warps = launch_config(rows, n, k)
    block_n, block_k, num_warps = block_n or default_n, block_k or default_k, num_warps or default_warps
    grid = ((n + block_n - 1) // block_n,)
    norm = 0 if pro is None or pro.norm is None else (1 if pro.norm == "rms" else 2)
    nw = pro.norm_weight if norm else weight
    nb = pro.norm_bias if norm and pro.norm_bias is not None else weight
    _skinny_gemm_kernel[grid](x2, weight, bias if bias is not None else weight, out, res, nw, nb, res_out,
                              rows, n, k, x2.stride(0), weight.stride(0), out.stride(0), res.stride(0),
                              res_out.stride(0), float(pro.eps) if pro is not None else 0.0,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                              NORM=norm, HAS_RES=bool(norm) and pro.residual is not None,
                              NORM_BIAS=bool(norm) and pro.norm_bias is not None,
                              ACT=_ACTS[pro.act] if pro is not None else 0,
                              GATED=pro is not None and pro.gated, num_warps=num_warps)
    return out.view(*shape[:-1], n)
