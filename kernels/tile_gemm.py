"""``y = act(x @ W.T + b)`` for a decode step's batch of rows (2-256; the engine sends it up to
64): a tensor-core tile GEMM that launches programmatically.

A decode step at C=64 runs ~150 products of 64 rows; each costs cuBLAS about 4 us on an H100 or
an H200 alike, 4-8x its weight read (docs/benchmarks.md, session 33's ``gemm_probe.py``): the
time is the launch and the K loop's memory latency, not the bytes or the tile count. cuBLAS
cannot overlap either with the kernel before it. This kernel can (``set_programmatic_launch``):
launched while the previous kernel of the step still runs, each program first asks L2 for its
weight rows (no earlier kernel of the step writes weights), then waits for the previous
kernel's memory, so its K loop reads weights from L2 and the launch gap is gone. Without
programmatic launch it is a plain tile GEMM (no faster than cuBLAS, session 33), so the engine
takes it only with programmatic launch on (``tuning.tile_gemm``).

Programs are ``BLOCK_N`` output features by ``BLOCK_M`` rows (narrow, so even a 1024-wide
product keeps many SMs reading); the activation epilogue (``act``, ``gated``) is the skinny
GEMV's, so a gated MLP's gate|up product and ``act(gate) * up`` stay one kernel here too, and so
is its input ``Prologue``: a pre-norm (+ residual add) computed as the rows load.
"""
from __future__ import annotations

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import skinny_linear_ref
from .skinny_gemm import ACTIVATIONS, Prologue, _epilogue, _prefetch_rows, activation_ref, input_args

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

MIN_ROWS = 2      # one row is the skinny GEMV's
MAX_ROWS = 256    # the most rows it takes; ``tile_pays`` says where it is the faster product


@lazy_jit
def _tile_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, nb_ptr, res_out_ptr,
                      M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, NORM_BIAS: tl.constexpr,
                      ACT: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # out[M, N] = act(x[M, K] @ w[N, K].T + b); GATED: weight rows [N, 2N) are the "up" half
    # and out[:, n] = act(x . w[n]) * (x . w[N + n]). EVEN_K: K % BLOCK_K == 0, no K mask.
    # IEEE: float32 operands multiplied as float32 (tl.dot's default would round them to tf32).
    # Prologue, NORM: 0 none, 1 RMSNorm, 2 LayerNorm of x (+ residual with HAS_RES, the sum
    # rounded to the activation dtype; the programs of the first feature tile write it out).
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    up_ptr = w_ptr + N.to(tl.int64) * stride_wn
    if PDL:
        # The programs of one column of tiles read the same weight rows: the first asks for them.
        if pid_m == 0:
            _prefetch_rows(w_ptr, offs_n, mask_n, stride_wn, K, BLOCK_K)
            if GATED:
                _prefetch_rows(up_ptr, offs_n, mask_n, stride_wn, K, BLOCK_K)
        wait_for_previous_kernel()      # before the first activation load
    act_dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm
    w_rows = offs_n[None, :].to(tl.int64) * stride_wn
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM != 0:
        # Row statistics over K first (a LayerNorm's variance in a second pass, centred as the
        # norm kernel's), each row's pieces read from L2.
        s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K, HAS_RES, EVEN_K)
            s1 += tl.sum(h * h if NORM == 1 else h, axis=1)
        if NORM == 1:
            rstd = tl.rsqrt(s1 / K + eps)
        else:
            mean = s1 / K
            s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                h = _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K, HAS_RES, EVEN_K)
                offs_k = k0 + tl.arange(0, BLOCK_K)
                c = tl.where(((offs_k < K) | EVEN_K)[None, :], h - mean[:, None], 0.0)
                s2 += tl.sum(c * c, axis=1)
            rstd = tl.rsqrt(s2 / K + eps)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) | EVEN_K
        mk = mask_m[:, None] & mask_k[None, :]
        if NORM != 0:
            h = _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K, HAS_RES, EVEN_K)
            if HAS_RES:
                tl.store(res_out_ptr + offs_m[:, None].to(tl.int64) * stride_rom + offs_k[None, :],
                         h.to(act_dtype), mask=mk & (pid_n == 0))
            a = (h - mean[:, None]) * rstd[:, None] * tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if NORM_BIAS:
                a = a + tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            a = a.to(act_dtype)
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0)                               # [BM, BK]
        mask_w = mask_n[None, :] & mask_k[:, None]
        b = tl.load(w_ptr + w_rows + offs_k[:, None], mask=mask_w, other=0.0)                       # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision="ieee" if IEEE else None)
        if GATED:
            b_up = tl.load(up_ptr + w_rows + offs_k[:, None], mask=mask_w, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee" if IEEE else None)
    acc = _epilogue(acc, acc_up, b_ptr, offs_n, mask_n, N, act_dtype, HAS_BIAS, ACT, GATED)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(act_dtype),
             mask=mask_m[:, None] & mask_n[None, :])


@lazy_jit.helper
def _norm_input(x_rows, r_rows, k0, K, mask_m, act_dtype, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr,
                EVEN_K: tl.constexpr):
    # [BM, BK] of x (+ residual, rounded to the activation dtype as the model's sum is) in fp32
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mk = mask_m[:, None] & ((offs_k < K) | EVEN_K)[None, :]
    h = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
        h = (h + r).to(act_dtype).to(tl.float32)
    return h


def launch_config(rows: int, n: int, k: int, itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``[rows, k] x [n, k]^T`` product
    of ``itemsize``-byte elements.

    From session 37's sweep on an H100 (``gemm_probe.py --triton --pdl``, 64 rows, flan-t5-large's
    and whisper-large-v3's decode products, docs/benchmarks.md): four stages; 32 features by 128 of
    K for square products up to 1280 (1024 x 1024: 3.15 us against cuBLAS's 4.13), 32 by 256 for
    q|k|v (3072 x 1024: 4.32 against 5.28), 16 by 256 for a long K (1024 x 2816: 5.96 against
    7.08), 64 by 128 from 4,096 features (whisper's head: 57.2 against 80.4). Rows are tiled by up
    to 64 (``tl.dot`` needs 16). Float32 takes half the K step and three stages, within shared
    memory; a K that no step divides (small test models) takes 16-64 with its tail masked."""
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if n >= 4096:
        block_n, block_k = 64, 128
    elif k > 2048:
        block_n, block_k = 16, 256
    elif n > 2048:
        block_n, block_k = 32, 256
    else:
        block_n, block_k = 32, 128
    stages = 4
    if itemsize > 2:
        block_k, stages = block_k // 2, 3
    if k % block_k:
        block_k = 64 if k % 64 == 0 else min(64, max(16, 1 << (k - 1).bit_length()))
    return block_m, block_n, block_k, 4, stages


def tile_pays(rows: int, n: int, k: int, fused_act: bool) -> bool:
    """Whether the tile GEMM (launched programmatically) beats cuBLAS on this product, by session
    37's sweep on an H100: at up to 64 rows, on every product of at most ~5M weights and on the LM
    heads, not on the wide plain ones (whisper's 5120 x 1280 fc1: 8.0 us against 7.3; 1280 x 5120
    fc2: 10.3 against 9.6) unless the MLP's activation rides in it (a kernel saved); at 128 rows
    cuBLAS won every shape but the square ones (flan-t5-large's products 0.775 against 0.770 ms)."""
    return rows <= 64 and (fused_act or n * k <= 5 << 20 or n >= 32768)


def tile_linear_supported(rows: int, weight: torch.Tensor) -> bool:
    """Whether ``tile_linear`` runs its kernel for this many rows of this weight (else the reference)."""
    return MIN_ROWS <= rows <= MAX_ROWS and weight.shape[-1] >= 16 and weight.stride(-1) == 1 and \
        weight.dtype in (torch.bfloat16, torch.float16, torch.float32)


def tile_linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                act: str | None = None, gated: bool = False,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` with ``MIN_ROWS``-``MAX_ROWS`` rows of a
    ``weight [N, K]`` (K >= 16; float32 multiplied as float32); ``x`` may be a ``Prologue`` (its
    norm computed as the rows load; the first feature tile's programs write its new residual),
    ``act`` and ``gated`` as ``skinny_linear``'s. Other inputs (or no Triton) take the torch
    references. ``config`` overrides ``launch_config`` (``bench/scripts/gemm_probe.py``)."""
    pro = x if isinstance(x, Prologue) else None
    src = pro.x if pro is not None else x
    rows = src.numel() // src.shape[-1] if src.shape[-1] else 0
    if not tile_linear_supported(rows, weight) or src.dtype != weight.dtype or not can_use_triton(src, weight):
        return activation_ref(skinny_linear_ref(pro.materialize() if pro is not None else x, weight, bias), act, gated)
    n, k = weight.shape
    if gated:
        assert n % 2 == 0, f"a gated product needs an even number of weight rows, got {n}"
        n //= 2
    inputs = input_args(x, rows, k, weight)
    out = torch.empty((rows, n), dtype=src.dtype, device=src.device)
    if config is None:
        # a gated product reads both halves: the tiling of its whole weight, each half's tile half as wide
        block_m, block_n, block_k, num_warps, num_stages = launch_config(rows, weight.shape[0], k, weight.element_size())
        block_n = max(16, block_n // 2) if gated else block_n
        # a normalised input tile is made in registers and staged for the dot: two stages leave room
        num_stages = 2 if pro is not None else num_stages
    else:
        block_m, block_n, block_k, num_warps, num_stages = config
    grid = (-(-n // block_n), -(-rows // block_m))
    x2 = inputs.x
    _tile_gemm_kernel[grid](x2, weight, bias if bias is not None else weight, out, inputs.res, inputs.nw, inputs.nb,
                            inputs.res_out, rows, n, k, x2.stride(0), weight.stride(0), out.stride(0),
                            inputs.res.stride(0), inputs.res_out.stride(0), inputs.eps,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                            NORM=inputs.norm, HAS_RES=inputs.has_res, NORM_BIAS=inputs.norm_bias,
                            ACT=ACTIVATIONS[act], GATED=gated, IEEE=weight.dtype == torch.float32,
                            EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages,
                            **launch_options(x2))
    return out.view(*src.shape[:-1], n)
