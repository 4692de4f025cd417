"""Decode-step projections through the skinny GEMV kernel, applied from outside the models.

A decoder step at small batch multiplies a few rows by every weight matrix once; there the
library GEMM reaches a fraction of the memory bandwidth, and ``kernels.skinny_linear``
streams the weights instead. ``use_skinny_linear(model)`` rebinds the ``forward`` of every
plain ``nn.Linear`` (fused ``MergedLinear`` included) so calls with at most
``DISPATCH_ROWS`` rows take the kernel and larger ones (batched decode steps, encoder
batches, prompt steps) keep ``F.linear``. Tensor-parallel row layers keep their
all-reduce: only their local product (``RowParallelLinear.matmul``) is swapped; other
subclasses are left alone.
On one-row steps the pre-norms ride in the GEMV that reads them (``Prologue``) and the MLP
activation in the GEMV that produces its input, and the q|k|v GEMV stores the new k and v:
a flan-t5-large step runs 258 kernels instead of 378 (docs/benchmarks.md, run I).
``ENC2DEC_SKINNY_GEMM=0`` turns it all off, ``ENC2DEC_FUSED_GEMV=0`` only the fusion (ablation).
"""
from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.layers import DenseMLP, GatedMLP, MergedLinear, RowParallelLinear, SelfAttention
from enc2dec.kernels.skinny_gemm import Prologue, skinny_linear      # triton itself loads at the first launch

logger = logging.getLogger("enc2dec")


# Rows up to which the kernel replaces the library GEMM. Measured on an H200 (docs/benchmarks.md,
# runs F and G): at 1 row it beats cuBLAS (flan-t5-large TPOT 1.2 vs 1.5 ms); at 8 rows it is
# far slower (C=8 TPOT 3.1 ms against 1.8 ms at C=64 without it). 2-7 rows are unmeasured, so
# they stay with the library.
DISPATCH_ROWS = 1


def linear(x: torch.Tensor | Prologue, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that sends single-row inputs (and deferred norms/activations) to the GEMV kernel."""
    if isinstance(x, Prologue) or (x.shape[-1] and x.numel() // x.shape[-1] <= DISPATCH_ROWS):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def skinny_linear_enabled(device: torch.device, backend_name: str) -> bool:
    return (device.type == "cuda" and backend_name == "triton"
            and os.environ.get("ENC2DEC_SKINNY_GEMM", "1") != "0")


def use_skinny_linear(model: nn.Module, fuse: bool | None = None) -> int:
    """Rebind plain linear layers of ``model``; returns how many. With ``fuse`` (default: unless
    ``ENC2DEC_FUSED_GEMV=0``), on one-row calls the norms the model lists in its layers'
    ``gemv_fed_norms()`` are deferred into the GEMV that reads them (``Prologue``), each
    MLP's activation (gated: ``act(gate) * up``) rides in its first GEMV, and decoder
    self-attention's q|k|v GEMV stores k and v in the cache (``kernels/skinny_gemm.py``)."""
    if fuse is None:
        fuse = os.environ.get("ENC2DEC_FUSED_GEMV", "1") != "0"
    count = fused = 0
    for module in model.modules():
        if type(module) in (nn.Linear, MergedLinear):
            module.forward = types.MethodType(_forward, module)
            count += 1
        elif type(module) is RowParallelLinear:
            module.matmul = linear
            count += 1
    for module in model.modules() if fuse else ():
        first = getattr(module, "fc1", None) or getattr(module, "gate_up", None)
        if type(module) in (DenseMLP, GatedMLP) and type(first) is MergedLinear:
            module.act_into_gemv = True
            fused += 1
        if type(module) is SelfAttention and type(module.qkv) is MergedLinear:
            module.store_in_gemv = True
            fused += 1
        for norm in getattr(module, "gemv_fed_norms", lambda: ())():
            norm.into_gemv = True
            fused += 1
    logger.info("skinny GEMV kernel on %d linear layers for steps of %d row(s); %d norms, activations "
                "and K/V stores ride in it", count, DISPATCH_ROWS, fused)
    return count
