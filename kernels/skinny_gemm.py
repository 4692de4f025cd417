"""``y = x @ W.T + b`` for skinny ``x`` (a decode step's few rows): a weight-streaming GEMV.

At batch 1-8 a decoder step is bound by reading the weights once; the library GEMMs pick
tensor-core tiles made for larger M and reach a fraction of the memory bandwidth there.
This kernel gives each program ``BLOCK_N`` output features and streams their weight rows
``[BLOCK_N, K]`` once, multiplying every one of the ``M <= 16`` input rows against them in
fp32 (a broadcast multiply-reduce, no tensor cores: the work is memory-bound). Many small
programs (N / BLOCK_N of them) keep every SM reading.

Used from outside the models (``engine/fast_linear.py`` swaps plain ``nn.Linear`` forwards
on the GPU); larger M goes to ``F.linear``.
"""
from __future__ import annotations

import torch

from . import can_use_triton, lazy_jit
from .reference import skinny_linear_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

MAX_ROWS = 16


@lazy_jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                         # [BN]
    offs_m = tl.arange(0, BLOCK_M)                                         # [BM]
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                                # [BK]
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)    # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)    # [BM, BK]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)                # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` with at most ``MAX_ROWS`` rows;
    ``weight [N, K]`` row-major. More rows (or no Triton) fall back to ``F.linear``.
    ``block_n``/``block_k``/``num_warps`` override ``launch_config`` (bench/tune_skinny.py)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > MAX_ROWS or rows == 0 or not can_use_triton(x, weight) or weight.stride(-1) != 1:
        return skinny_linear_ref(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = max(1, 1 << (rows - 1).bit_length())
    default_n, default_k, default_warps = launch_config(rows, n, k)
    block_n, block_k, num_warps = block_n or default_n, block_k or default_k, num_warps or default_warps
    grid = ((n + block_n - 1) // block_n,)
    _skinny_gemm_kernel[grid](x2, weight, bias if bias is not None else weight, out, rows, n, k,
                              x2.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=num_warps)
    return out.view(*x.shape[:-1], n)
