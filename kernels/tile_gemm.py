"""``y = rms_norm(x + residual) @ W.T`` for a decode step of 2-256 rows (or an encoder batch), on
tensor cores, with the norm before it and the activation or K/V store after it in the same launch.

At C=64 a flan-t5-large decode step runs about 400 kernels (docs/benchmarks.md, Run N), and per
decoder layer five of them are only there because the library GEMM cannot take a prologue or
an epilogue: three add+RMSNorm kernels in front of the q|k|v, cross-q and gate|up projections,
the K/V store after q|k|v and the gated activation after gate|up. At these sizes each is a few
microseconds of launch and tail on a step of ~2 ms (issue 19: "norm prologues and activation
epilogues for multi-row GEMMs"). The one-row GEMV (``skinny_gemm``) fuses the same things
without tensor cores; it is far slower than cuBLAS from 8 rows up.

The RMSNorm is folded rather than computed first: ``rms(h) * g @ W.T`` is
``rstd[m] * ((h * g) @ W.T)[m]`` with ``rstd[m]`` from the same ``h`` tiles the K loop already
loads, so no program reads its rows twice. The product therefore sees ``h * g`` rounded once to
the activation dtype, where the separate kernels round ``h * rstd`` and then its product by
``g``: equal to float32 rounding in float32, within bf16 rounding in bf16 (the tests' bounds),
not bit for bit. LayerNorm is not folded (its mean term would subtract two large dot products
in bf16); a LayerNorm ``Prologue`` is computed first by the reference.

The kernel takes any number of rows (an encoder batch gets a 128 x 128 compute tile):
``bench/scripts/tile_gemm_bench.py --encoder`` times Whisper's encoder fc1 with its erf-GELU in
the epilogue against cuBLAS + the GELU kernel (cuBLASLt's GELU epilogue is the tanh form).
``engine/runner/fast_linear.py`` routes the decoder layers' fused calls of 2-256 rows here
under ``tuning.tile_gemm`` (off until timed on a GPU: ``bench/scripts/tile_gemm_bench.py``
against the separate kernels + cuBLAS at flan-t5-large's shapes, then ``enc2dec bench``).
"""
from __future__ import annotations

import torch

from . import can_use_triton, interpreting, lazy_jit
from .skinny_gemm import ACTIVATIONS, GemmOperands, Prologue, _epilogue, _store_k_and_v, fused_linear_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

# The most rows of a decode step the engine sends here (tuning.tile_gemm); the kernel itself takes
# any number (an encoder batch's, for bench/scripts/tile_gemm_bench.py --encoder).
DECODE_ROWS = 256


@lazy_jit
def _tile_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps, kv_width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    STORE_KV: tl.constexpr, F32_DOT: tl.constexpr,
):
    # RMS: x is h (+ residual with HAS_RES; the N-block 0 programs write h to res_out), the
    # product is rstd * ((h * g) @ W.T). ACT: 0 none, 1 gelu (erf), 2 gelu (tanh), 3 relu;
    # GATED: weight rows [N, 2N) are the up half. STORE_KV: out is q|k|v, kv_width each; k and v
    # also go to the contiguous [blocks, tokens_per_block, heads, head_dim] caches at each row's
    # slot (< 0: nowhere). F32_DOT: the products in float32 without TF32 (float32 models, and
    # the interpreter, whose dot reads bfloat16 operands as raw bits).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                       # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    act_dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                                # [BK]
        mask_k = offs_k < K
        mk = mask_m[:, None] & mask_k[None, :]
        a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mk, other=0.0)
        if RMS:
            h = a.to(tl.float32)
            if HAS_RES:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_k[None, :], mask=mk, other=0.0)
                hr = (h + r.to(tl.float32)).to(act_dtype)
                tl.store(res_out_ptr + rows[:, None] * stride_rom + offs_k[None, :], hr, mask=mk & (pid_n == 0))
                h = hr.to(tl.float32)
            ss += tl.sum(h * h, axis=1)
            g = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = (h * g[None, :]).to(act_dtype)
        mw = mask_k[:, None] & mask_n[None, :]
        w_offs = cols[None, :] * stride_wn + offs_k[:, None]                # [BK, BN]: W.T's tile
        w = tl.load(w_ptr + w_offs, mask=mw, other=0.0)
        if F32_DOT:
            a = a.to(tl.float32)
            acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            w_up = tl.load(w_ptr + N.to(tl.int64) * stride_wn + w_offs, mask=mw, other=0.0)
            if F32_DOT:
                acc_up += tl.dot(a, w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(a, w_up)
    if RMS:
        rstd = tl.rsqrt(ss / K + eps)
        acc = acc * rstd[:, None]
        if GATED:
            acc_up = acc_up * rstd[:, None]
    out = _epilogue(acc, acc_up, b_ptr, out_ptr, offs_n, mask_n, N, HAS_BIAS, ACT, GATED)
    mo = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=mo)
    if STORE_KV:
        _store_k_and_v(out, offs_m, offs_n, mask_m, mo, slot_ptr, k_cache_ptr, v_cache_ptr, kv_width)


def launch_config(rows: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): a first guess for weight-streaming
    shapes (every weight tile read once per row block; narrow N blocks so that even a
    1,024-wide output keeps most SMs reading). To be replaced by the sweep of
    bench/scripts/tile_gemm_bench.py on the GPU."""
    if rows > DECODE_ROWS:            # an encoder batch: compute-bound, the usual Hopper tile
        return 128, 128, 64, 8, 3
    block_m = min(128, max(16, 1 << (rows - 1).bit_length()))
    block_n = 32 if n <= 4096 else 64
    return block_m, block_n, 128, 4, 3


def tile_linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                act: str | None = None, gated: bool = False, kv_store: tuple | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, the
    arguments of ``skinny_gemm.skinny_linear`` (a ``Prologue`` input, ``act``, ``gated``,
    ``kv_store``). An RMSNorm ``Prologue`` is folded into the product (module docstring); a
    LayerNorm one, or no Triton fall back to the references. ``config``:
    ``launch_config``'s tuple, for the tuning script."""
    pro = x if isinstance(x, Prologue) else None
    src = pro.x if pro is not None else x
    rows = src.numel() // src.shape[-1] if src.shape[-1] else 0
    foldable = pro is None or pro.norm == "rms"
    if rows == 0 or not foldable or not can_use_triton(src, weight) \
            or weight.stride(-1) != 1:
        return fused_linear_ref(x, weight, bias, act, gated, kv_store)
    o = GemmOperands.of(pro, src, weight, gated, kv_store)
    block_m, block_n, block_k, num_warps, num_stages = config or launch_config(rows, o.n, o.k)
    grid = (-(-o.n // block_n), -(-rows // block_m))
    _tile_gemm_kernel[grid](o.x, weight, bias if bias is not None else weight, o.out, o.res,
                            pro.norm_weight if pro is not None else weight, o.res_out, o.k_cache, o.v_cache, o.slots,
                            rows, o.n, o.k, o.x.stride(0), weight.stride(0), o.out.stride(0), o.res.stride(0),
                            o.res_out.stride(0), float(pro.eps) if pro is not None else 0.0, o.kv_width,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                            RMS=pro is not None, HAS_RES=pro is not None and pro.residual is not None,
                            ACT=ACTIVATIONS[act], GATED=gated, STORE_KV=kv_store is not None,
                            F32_DOT=src.dtype == torch.float32 or interpreting(), num_warps=num_warps,
                            num_stages=num_stages)
    return o.out.view(*src.shape[:-1], o.n)
