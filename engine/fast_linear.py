"""Decode-step projections through the skinny GEMV kernel, applied from outside the models.

A decoder step at small batch multiplies a few rows by every weight matrix once; there the
library GEMM reaches a fraction of the memory bandwidth, and ``kernels.skinny_linear``
streams the weights instead. ``use_skinny_linear(model)`` rebinds the ``forward`` of every
plain ``nn.Linear`` (fused ``MergedLinear`` included) so calls with at most
``DISPATCH_ROWS`` rows take the kernel and larger ones (batched decode steps, encoder
batches, prompt steps) keep ``F.linear``. Tensor-parallel row layers keep their
all-reduce: only their local product (``RowParallelLinear.matmul``) is swapped; other
subclasses are left alone.
``ENC2DEC_SKINNY_GEMM=0`` turns it off (ablation).
"""
from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.layers import MergedLinear, RowParallelLinear
from enc2dec.kernels.skinny_gemm import skinny_linear      # triton itself loads at the first launch

logger = logging.getLogger("enc2dec")


# Rows up to which the kernel replaces the library GEMM. Measured on an H200 (docs/benchmarks.md,
# runs F and G): at 1 row it beats cuBLAS (flan-t5-large TPOT 1.2 vs 1.5 ms); at 8 rows it is
# far slower (C=8 TPOT 3.1 ms against 1.8 ms at C=64 without it). 2-7 rows are unmeasured, so
# they stay with the library.
DISPATCH_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that sends single-row inputs to the GEMV kernel."""
    if x.shape[-1] and x.numel() // x.shape[-1] <= DISPATCH_ROWS:
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def skinny_linear_enabled(device: torch.device, backend_name: str) -> bool:
    return (device.type == "cuda" and backend_name == "triton"
            and os.environ.get("ENC2DEC_SKINNY_GEMM", "1") != "0")


def use_skinny_linear(model: nn.Module) -> int:
    """Rebind plain linear layers of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, MergedLinear):
            module.forward = types.MethodType(_forward, module)
            count += 1
        elif type(module) is RowParallelLinear:
            module.matmul = linear
            count += 1
    logger.info("skinny GEMV kernel on %d linear layers for steps of %d row(s)", count, DISPATCH_ROWS)
    return count
