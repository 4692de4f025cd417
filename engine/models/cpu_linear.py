"""CPU projections of a few rows through MKL's packed sgemm, applied to a model from outside.

A decode step of C sequences multiplies C rows by every weight matrix. At a few rows (2-8 on
an AMD EPYC, 4-8 on an Intel Xeon: ``MIN_ROWS``) MKL's ordinary sgemm runs far below the rate
at which the weights can be read; with the weight packed once into MKL's internal layout
(``cblas_sgemm_pack``, what inductor's CPU freezing uses) the same product takes ~0.7x the
time (flan-t5-small's decoder linears at 4 rows, 2 cores: 10.6 -> 7.6 ms per step). Short
encoder batches gain too: a T5 prompt of 32 tokens is a 32-row product in every encoder linear,
where ordinary sgemm spends most of its call packing the weight (flan-t5-small's [32, 512] x
[512, 2048]: 403 us, packed 246 us). One row (a GEMV) and long batches gain nothing (at 96 rows
and over the ordinary call is as fast), so they keep ``F.linear``.

A packed weight serves one row count only (MKL's packed compute takes the m it was packed
for; ``torch.ops.mkl._mkl_linear`` falls back to ``F.linear`` for any other). So each layer
packs lazily, per row count, for at most ``MAX_PACKS`` counts; each pack costs the weight's
size in memory. Steps of 2-8 rows take a pack of their own count; 9-64 rows are padded up to
a bucket (``BUCKET_ROWS``), so that prompts of nearby lengths share a pack (each output row
depends on its own input row only, so padding cannot change a real row). The products agree
with ``F.linear`` to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from enc2dec.engine.models.layers import DenseMLP, MergedLinear, RowParallelLinear

logger = logging.getLogger("enc2dec")


def _cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# Row counts that take the packed product of their own count (decode steps of a few sequences).
# MKL picks its small-m kernels by CPU: on the AMD EPYC of session 15 the packs won from 2 rows;
# on an Intel Xeon (AVX-512, AMX) plain sgemm beats them at 2-3 rows ([r, 512] x [512, 2048]:
# 81-84 against 90-99 us) and loses from 4 (126 against 113): flan-t5-small's decode step with
# 2-3 rows packed 11.74 / 12.96 ms, unpacked 11.05 / 12.05.
MIN_ROWS = 4 if _cpu_vendor() == "GenuineIntel" else 2
MAX_ROWS = 8
# Larger counts up to the last bucket are padded up to the next bucket's pack. A padded row costs
# as much as a real one, so the buckets are close enough that the pack wins at every count
# (measured on 2 cores, us per product, F.linear against the bucket's pack): flan-t5-small's
# [r, 512] x [512, 2048] at 17 / 24 / 33 / 64 rows 310 / 325 / 381 / 525 against 181 / 175 /
# 285 / 389; bart-large's [r, 1024] x [1024, 3072] 871 / 954 / 1134 / 1691 against 569 / 567 /
# 924 / 1335. Bucket 64 alone for 33-64 rows lost: 40 rows padded to 64 took 1,895 us in
# bart-large's fc2 against F.linear's 1,751 (bart-large's TTFT at 40 tokens 9% worse), where
# bucket 48 took 1,407. At 96 rows F.linear wins (622 against two 64-row packs' 845).
BUCKET_ROWS = (16, 24, 32, 48, 64)
# Distinct row counts packed per layer; further ones keep F.linear rather than repacking.
MAX_PACKS = 2
# A row count packs on its this-many-th call: packing a layer costs about as much as one
# product with a fresh copy of the weight (a whisper-base run paid ~0.7 s packing on its first
# pass), so the row counts of a few tail steps never pay it.
PACK_AFTER_CALLS = 16
# A bucket packs sooner: encoder layers see one call per encode, and a bucket gathers the
# prompts of several lengths, so its second call is the sign of a workload that repeats it.
BUCKET_PACK_AFTER_CALLS = 2
# Of a layer's MAX_PACKS, buckets take at most this many, and a model's bucket packs at most
# BUCKET_PACK_BYTES of weights (``PackBudget``). Packing is a one-time cost of about a copy of the
# weight into fresh memory, which first-touch page faults make far dearer on some VMs: this CI
# machine type took 80 ms for a 42 MB byt5-small weight in the engine (12 ms in a fresh
# process), 1.7 s for all of byt5-small's encoder at one bucket, which a 64-request run at C=2
# did not earn back (48.9 against 51.4 out tok/s; E2E p50 258 against 296 ms). The budget keeps a
# short run's one-time cost near 0.5 s there while a small model (flan-t5-small's encoder and
# cross K/V: ~90 MB) packs whole.
MAX_BUCKET_PACKS = 1
BUCKET_PACK_BYTES = 256 << 20


class PackBudget:
    """Bytes of weight a model may still pack for buckets; shared by all its linear layers."""

    def __init__(self, nbytes: int = BUCKET_PACK_BYTES):
        self.left = nbytes

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def packed_linear(packs: dict, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  budget: PackBudget | None = None) -> torch.Tensor:
    """``F.linear`` through a packed copy of ``weight`` kept in ``packs`` (row count -> pack;
    ``"seen"``: calls per row count not packed yet). ``budget``: the model's for bucket packs
    (none: no limit)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # The packed op has no autograd: weights that train keep F.linear.
    if not MIN_ROWS <= rows <= BUCKET_ROWS[-1] or x.dtype != torch.float32 or weight.requires_grad:
        return F.linear(x, weight, bias)
    if rows <= MAX_ROWS:
        m, after = rows, PACK_AFTER_CALLS
    else:
        m, after = next(b for b in BUCKET_ROWS if rows <= b), BUCKET_PACK_AFTER_CALLS
    packed = packs.get(m)
    if packed is None:
        seen = packs["seen"] = packs.get("seen", {})
        seen[m] = seen.get(m, 0) + 1
        held = [k for k in packs if k != "seen"]
        if seen[m] < after or len(held) >= MAX_PACKS:
            return F.linear(x, weight, bias)
        if m > MAX_ROWS and (sum(k > MAX_ROWS for k in held) >= MAX_BUCKET_PACKS
                             or (budget is not None and not budget.take(weight.numel() * weight.element_size()))):
            return F.linear(x, weight, bias)
        packed = packs[m] = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
    return _padded_product(x, rows, packed, weight, bias, m)


def _padded_product(x: torch.Tensor, rows: int, packed: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, m: int) -> torch.Tensor:
    """The product of ``x``'s ``rows`` rows through a pack made for ``m >= rows`` rows: MKL's
    packed compute takes the m it was packed for, so zero rows pad it and are cut off after."""
    if rows == m:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, m)
    x2 = x.reshape(rows, x.shape[-1])
    x2 = torch.cat([x2, x2.new_zeros(m - rows, x2.shape[1])])
    out = torch.ops.mkl._mkl_linear(x2, packed, weight, bias, m)[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def _packed_linear(module: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(module.__dict__.setdefault("_mkl_packs", {}), x, module.weight, bias,
                         module.__dict__.get("_mkl_budget"))


# The LM head (the largest weight a decode step reads: 66-106 MB in float32 for the small
# checkpoints) is packed for these row counts, and a step of fewer rows is padded up to the next
# one: the product streams the packed weight once whatever the row count (whisper-base's head, 2
# cores: F.linear 4.1 / 4.5 / 6.5 / 8.7 ms at 4 / 6 / 8 / 12 rows, the packs 2.4 / 2.8 / 3.0 /
# 3.9 ms; at 1-3 rows F.linear streams it as fast, ~2.1 ms). Padding cannot change the real rows:
# each output row depends on its own input row only. At most HEAD_MAX_PACKS packs (each about
# 1.3x the weight's size), the first counts reached.
HEAD_PACK_ROWS = (4, 8, 16)
HEAD_MAX_PACKS = 2
# A pack costs about 30 ms for whisper-base's head: worth it after a few steps in its range,
# where the layers' packs wait for 16 (they are many and gain less each).
HEAD_PACK_AFTER_CALLS = 3


class PackedHead:
    """The LM head's product (``EncoderDecoderLM.head_product``) through MKL's packed sgemm, for
    steps of ``HEAD_PACK_ROWS[0]`` to ``HEAD_PACK_ROWS[-1]`` rows, padded up to a packed row count."""

    def __init__(self):
        self.packs: dict[int, torch.Tensor] = {}
        self.seen: dict[int, int] = {}

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if not HEAD_PACK_ROWS[0] <= rows <= HEAD_PACK_ROWS[-1] or hidden.dtype != torch.float32 \
                or weight.requires_grad or hidden.dim() != 2:
            return F.linear(hidden, weight)
        m = next(b for b in HEAD_PACK_ROWS if rows <= b)
        packed = self.packs.get(m)
        if packed is None:
            self.seen[m] = self.seen.get(m, 0) + 1
            if self.seen[m] < HEAD_PACK_AFTER_CALLS or len(self.packs) >= HEAD_MAX_PACKS:
                return F.linear(hidden, weight)
            packed = self.packs[m] = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
        return _padded_product(hidden, rows, packed, weight, None, m)


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


# Rows from which an MLP's first projection runs through oneDNN with its bias and activation
# fused in (measured at 7,500 rows, five Whisper windows: 78 ms against 96 ms for F.linear then
# F.gelu, 2 cores; at the 1,500 rows of one window 23 against 24-29 ms). Below this, decode steps
# keep the packed or plain product (at one row oneDNN's call costs 2x F.linear's).
FUSED_ACT_MIN_ROWS = 64
# Activations oneDNN's post-op applies exactly as torch does (its "gelu" is the erf form).
_ONEDNN_ACTS = {F.gelu: "gelu", F.relu: "relu"}
# Rows of an encoder batch whose MLP runs at once: glibc maps every allocation over 32 MB afresh
# (and unmaps it when freed), so the [rows, d_ff] activation of a whole batch (37 MB at three
# Whisper windows) page-faults every 4 KB of itself in every layer; chunks of this many rows stay
# under it and are reused from the heap, and each chunk's activation is still in cache for fc2.
MLP_CHUNK_ROWS = 1024


class FusedActCpuDenseMLP(DenseMLP):
    """fc1 -> act -> fc2 where fc1's bias add and activation ride in oneDNN's product on large
    batches: the activation is applied while the output tile is still in cache, instead of a
    second pass over [rows, d_ff] (and a third: addmm first copies the bias into the output)."""

    plain_class = DenseMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = _ONEDNN_ACTS.get(self.act)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        fc1 = self.fc1
        if act is None or rows < FUSED_ACT_MIN_ROWS or x.dtype != torch.float32 or fc1.weight.requires_grad:
            return super().forward(x)
        scalars, algo = ([None], "none") if act == "gelu" else ([], "")
        x2 = x.reshape(rows, x.shape[-1])
        # [rows, d_ff / tp] per chunk, fc2 (its own product, bias and all-reduce) over each
        outs = [self.fc2(torch.ops.mkldnn._linear_pointwise(x2[s:s + MLP_CHUNK_ROWS], fc1.weight, fc1.bias, act,
                                                            scalars, algo))
                for s in range(0, rows, MLP_CHUNK_ROWS)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(*x.shape[:-1], -1)


_PACKED_CLASSES = {nn.Linear: PackedCpuLinear, MergedLinear: PackedCpuMergedLinear,
                   RowParallelLinear: PackedCpuRowParallelLinear}


def packed_cpu_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the packed product runs: float32 on the CPU with MKL."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available() \
        and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_packed_cpu_linear(model: nn.Module) -> int:
    """Swap the classes of the model's plain linear layers (and, where oneDNN is built in, of
    its dense MLPs); returns how many linears."""
    count = 0
    fuse_act = onednn_linear_available()
    budget = PackBudget()
    for module in model.modules():
        cls = _PACKED_CLASSES.get(type(module))
        if cls is not None:
            module.__class__ = cls
            module._mkl_budget = budget
            count += 1
        elif fuse_act and type(module) is DenseMLP:
            module.__class__ = FusedActCpuDenseMLP
    if hasattr(model, "head_product"):
        model.head_product = PackedHead()
    logger.info("MKL packed sgemm on %d linear layers for products of %d-%d rows", count, MIN_ROWS, BUCKET_ROWS[-1])
    return count
