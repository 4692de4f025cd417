"""GELU (exact erf or tanh approximation) and gated GELU for T5 v1.1 / Flan-T5 MLPs.

The gated input is the fused gate/up projection ``[..., 2F]``: columns ``[0, F)`` are the
gate (HF ``wi_0``), ``[F, 2F)`` the up projection (``wi_1``); the output is
``gelu(gate) * up``. T5 v1.1's ``gelu_new`` is the tanh approximation. Math is fp32.
"""
from __future__ import annotations

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import gated_gelu_ref, gelu_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

_APPROXIMATIONS = ("none", "tanh")


@lazy_jit
def _gelu_kernel(
    x_ptr, out_ptr, num_cols, stride_x, stride_o,
    BLOCK: tl.constexpr, GATED: tl.constexpr, TANH: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                  # [BLOCK]
    mask = offs < num_cols
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)                # sqrt(2/pi) * (...)
        e = tl.exp(-2.0 * tl.abs(u))                                         # in (0, 1]: no overflow
        tanh_abs = (1.0 - e) / (1.0 + e)
        y = 0.5 * g * (1.0 + tl.where(u >= 0, tanh_abs, -tanh_abs))
    else:
        y = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    if GATED:
        up = tl.load(x_ptr + row * stride_x + num_cols + offs, mask=mask, other=0.0)
        y = y * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, num_cols: int, gated: bool, approximate: str):
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not supported; valid: {', '.join(_APPROXIMATIONS)}")
    x2 = x.reshape(-1, x.shape[-1])                                         # [M, cols]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], num_cols), dtype=x.dtype, device=x.device)   # [M, F]
    if x2.shape[0] > 0 and num_cols > 0:
        block = min(1024, 1 << (num_cols - 1).bit_length())
        grid = (x2.shape[0], (num_cols + block - 1) // block)
        _gelu_kernel[grid](x2, out, num_cols, x2.stride(0), out.stride(0),
                           BLOCK=block, GATED=gated, TANH=approximate == "tanh", num_warps=4,
                           **launch_options(x2))
    return out.view(*x.shape[:-1], num_cols)


def gelu(x, approximate: str = "none"):
    """GELU of ``x [..., F]``: ``"none"`` = exact erf form, ``"tanh"`` = HF ``gelu_new``."""
    if not can_use_triton(x):
        return gelu_ref(x, approximate)
    return _launch(x, x.shape[-1], gated=False, approximate=approximate)


def gated_gelu(x, approximate: str = "tanh"):
    """``x [..., 2F]`` (gate | up) -> ``gelu(gate) * up [..., F]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"gated_gelu needs an even last dimension (gate | up), got {x.shape[-1]}")
    if not can_use_triton(x):
        return gated_gelu_ref(x, approximate)
    return _launch(x, x.shape[-1] // 2, gated=True, approximate=approximate)
