"""CPU projections of a few rows through MKL's packed sgemm, applied to a model from outside.

A decode step of C sequences multiplies C rows by every weight matrix. At 2-8 rows MKL's
ordinary sgemm runs far below the rate at which the weights can be read; with the weight
packed once into MKL's internal layout (``cblas_sgemm_pack``, what inductor's CPU freezing
uses) the same product takes ~0.7x the time (flan-t5-small's decoder linears at 4 rows, 2 cores:
10.6 -> 7.6 ms per step). One row (a GEMV) and encoder batches gain nothing, so they keep
``F.linear``.

A packed weight serves one row count only (MKL's packed compute takes the m it was packed
for; ``torch.ops.mkl._mkl_linear`` falls back to ``F.linear`` for any other). So each layer
packs lazily, per row count, for at most ``MAX_PACKS`` counts; each pack costs the weight's
size in memory. The products agree with ``F.linear`` to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.layers import MergedLinear, RowParallelLinear

logger = logging.getLogger("enc2dec")

# Row counts that take the packed product (decode steps of 2-8 sequences).
MIN_ROWS, MAX_ROWS = 2, 8
# Distinct row counts packed per layer; further ones keep F.linear rather than repacking.
MAX_PACKS = 2
# A row count packs on its this-many-th call: packing a layer costs about as much as one
# product with a fresh copy of the weight (a whisper-base run paid ~0.7 s packing on its first
# pass), so the row counts of a few tail steps never pay it.
PACK_AFTER_CALLS = 16


def packed_linear(packs: dict, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through a packed copy of ``weight`` kept in ``packs`` (row count -> pack;
    ``"seen"``: calls per row count not packed yet)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # The packed op has no autograd: weights that train keep F.linear.
    if not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != torch.float32 or weight.requires_grad:
        return F.linear(x, weight, bias)
    packed = packs.get(rows)
    if packed is None:
        seen = packs["seen"] = packs.get("seen", {})
        seen[rows] = seen.get(rows, 0) + 1
        if seen[rows] < PACK_AFTER_CALLS or len(packs) - 1 >= MAX_PACKS:
            return F.linear(x, weight, bias)
        packed = packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _packed_linear(module: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(module.__dict__.setdefault("_mkl_packs", {}), x, module.weight, bias)


class PackedHead:
    """The LM head's product (``EncoderDecoderLM.head_product``), packed like the layers."""

    def __init__(self):
        self.packs: dict = {}

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return packed_linear(self.packs, hidden, weight, None)


# Each packed class names the class it replaced (``plain_class``), so another path that swaps
# linear classes (the skinny GEMV, which tests apply on the CPU too) finds the plain one.
class PackedCpuLinear(nn.Linear):
    plain_class = nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(self, x, self.bias)


class PackedCpuMergedLinear(MergedLinear):
    plain_class = MergedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(self, x, self.bias)


class PackedCpuRowParallelLinear(RowParallelLinear):
    plain_class = RowParallelLinear

    def local_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _packed_linear(self, x, bias)


_PACKED_CLASSES = {nn.Linear: PackedCpuLinear, MergedLinear: PackedCpuMergedLinear,
                   RowParallelLinear: PackedCpuRowParallelLinear}


def packed_cpu_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the packed product runs: float32 on the CPU with MKL."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available() \
        and hasattr(torch.ops.mkl, "_mkl_linear")


def use_packed_cpu_linear(model: nn.Module) -> int:
    """Swap the classes of the model's plain linear layers; returns how many."""
    count = 0
    for module in model.modules():
        cls = _PACKED_CLASSES.get(type(module))
        if cls is not None:
            module.__class__ = cls
            count += 1
    if hasattr(model, "head_product"):
        model.head_product = PackedHead()
    logger.info("MKL packed sgemm on %d linear layers for steps of %d-%d rows", count, MIN_ROWS, MAX_ROWS)
    return count
