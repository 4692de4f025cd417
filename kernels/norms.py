"""Fused residual-add + RMSNorm (T5) and residual-add + LayerNorm (BART, mBART, Whisper).

One program per row holding the whole row (hidden sizes here are <= 8192). The sum
``x + residual`` is rounded to the residual's dtype before it is normalised, as the eager
model's ``residual + x`` would be; the statistics and the affine step are fp32.
"""
from __future__ import annotations

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import fused_add_layer_norm_ref, fused_add_rms_norm_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)


@lazy_jit
def _add_norm_kernel(
    x_ptr, res_ptr, weight_ptr, bias_ptr, out_ptr, res_out_ptr,
    hidden, eps, stride_x, stride_r, stride_o, stride_ro,
    BLOCK: tl.constexpr, IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)   # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (h + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, h, mask=mask)
        h = h.to(tl.float32)
    if IS_RMS:
        y = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    else:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / hidden, 0.0)
        y = centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / hidden + eps)
    y = y * tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _add_norm(x, residual, weight, bias, eps: float, is_rms: bool):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)                                              # [M, hidden]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        r2 = res_out = x2
    else:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        r2 = residual.reshape(-1, hidden).contiguous()
        res_out = torch.empty_like(r2)
    if x2.shape[0] > 0:
        block = 1 << (hidden - 1).bit_length()
        _add_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, bias if bias is not None else weight, out, res_out,
            hidden, eps, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            BLOCK=block, IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            num_warps=max(1, min(16, block // 256)), **launch_options(x2),
        )
    new_residual = x if residual is None else res_out.view(residual.shape)
    return out.view(x.shape), new_residual


def fused_add_rms_norm(x, residual, weight, eps: float):
    """T5 RMSNorm of ``x + residual`` -> ``(normed [..., hidden], new_residual)``.

    ``residual`` None normalises ``x`` and returns it as the new residual. No mean
    subtraction, no bias; ``weight [hidden]``; ``eps`` is the config's variance epsilon.
    """
    if not can_use_triton(x, weight):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _add_norm(x, residual, weight, None, eps, is_rms=True)


def fused_add_layer_norm(x, residual, weight, bias, eps: float):
    """LayerNorm of ``x + residual`` with ``weight``/``bias [hidden]`` (bias may be None)."""
    if not can_use_triton(x, weight):
        return fused_add_layer_norm_ref(x, residual, weight, bias, eps)
    return _add_norm(x, residual, weight, bias, eps, is_rms=False)
