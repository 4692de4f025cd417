"""KV cache sizing: the one place that turns a memory budget into pool sizes.

Engine start-up calls ``plan_kv_pools`` with the measured budget; the scheduler is built
from the plan's block counts; bench reports print ``plan.describe(...)``. Keeping the
arithmetic here means the three never disagree.

Both pools store, per position, K and V for every decoder layer with the decoder's
(per tensor-parallel rank) heads, so one ``bytes_per_token`` serves both: the
self-attention pool holds decoder positions, the cross-attention pool encoder positions.
"""
from __future__ import annotations

from dataclasses import dataclass

from enc2dec.engine.core.block_manager import blocks_needed

_GIB = 1 << 30
_MIB = 1 << 20


FP8_SCALE_BYTES = 2        # the float16 scale an FP8 pool keeps per position and head

# The CPU budget when ``max_cpu_memory_bytes`` is unset: this share of the memory available at
# start-up, at most AUTO_CPU_KV_MAX. CPU pools are mapped lazily (``KVCache.allocate``) and blocks
# are reused most recently freed first (``BlockPool``), so the process holds only the blocks of its
# high-water mark, not the whole budget. A fixed 512 MiB held
# whisper-base to 7 windows in flight, and each decode step then re-read the weights for fewer
# rows (a 300 s file: 16.5 s at 512 MiB, 14.7-15.0 s at 1-4 GiB, the same text).
AUTO_CPU_KV_SHARE = 0.25
AUTO_CPU_KV_MAX = 4 * _GIB
AUTO_CPU_KV_UNKNOWN = 512 * _MIB     # when the available memory cannot be read


def available_memory_bytes() -> int | None:
    """Memory this process can still take: Linux's MemAvailable, lowered to what the cgroup's
    limit leaves (a container); None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            left = max(0, int(limit) - current)
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def auto_cpu_kv_budget(available: int | None = None) -> int:
    """The CPU KV budget for an unset ``max_cpu_memory_bytes`` (see ``AUTO_CPU_KV_SHARE``)."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return AUTO_CPU_KV_UNKNOWN
    return int(min(AUTO_CPU_KV_MAX, available * AUTO_CPU_KV_SHARE))


def kv_bytes_per_token(num_layers: int, num_heads: int, head_dim: int, dtype_bytes: int, fp8: bool = False) -> int:
    """Bytes one position takes in a pool: K and V, all decoder layers, all (local) heads;
    ``fp8``: one byte per element plus each head row's scale, whatever ``dtype_bytes``."""
    for name, value in (("num_layers", num_layers), ("num_heads", num_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_head = head_dim + FP8_SCALE_BYTES if fp8 else head_dim * dtype_bytes
    return 2 * num_layers * num_heads * per_head


def format_bytes(num_bytes: int) -> str:
    if num_bytes >= _GIB:
        return f"{num_bytes / _GIB:.1f} GiB"
    if num_bytes >= _MIB:
        return f"{num_bytes / _MIB:.1f} MiB"
    return f"{num_bytes} bytes"


@dataclass(frozen=True)
class KvPoolPlan:
    num_self_blocks: int
    num_cross_blocks: int
    tokens_per_block: int
    bytes_per_block: int
    self_bytes: int     # num_self_blocks * bytes_per_block: what the self pool allocates
    cross_bytes: int    # num_cross_blocks * bytes_per_block

    def max_requests_by_cross(self, encoder_len: int) -> int:
        """Requests of ``encoder_len`` positions whose cross K/V fit at once."""
        return self.num_cross_blocks // max(1, blocks_needed(encoder_len, self.tokens_per_block))

    def max_seqs_by_self(self, decoder_len: int) -> int:
        """Decoder sequences of ``decoder_len`` positions whose self K/V fit at once."""
        return self.num_self_blocks // max(1, blocks_needed(decoder_len, self.tokens_per_block))

    def describe(self, encoder_len: int, max_decoder_len: int) -> str:
        return (
            f"self pool {self.num_self_blocks} blocks x {self.tokens_per_block} tokens "
            f"({format_bytes(self.self_bytes)}), cross pool {self.num_cross_blocks} blocks "
            f"({format_bytes(self.cross_bytes)}): holds "
            f"{self.max_requests_by_cross(encoder_len)} requests of {encoder_len} encoder "
            f"positions, {self.max_seqs_by_self(max_decoder_len)} sequences of "
            f"{max_decoder_len} decoder positions")


def plan_kv_pools(budget_bytes: int, cross_kv_cache_fraction: float, tokens_per_block: int,
                  bytes_per_token: int) -> KvPoolPlan:
    """Split ``budget_bytes`` between the pools: cross = budget * fraction, self = the rest."""
    if not 0.0 < cross_kv_cache_fraction < 1.0:
        raise ValueError(
            f"cross_kv_cache_fraction must be strictly between 0 and 1, got "
            f"{cross_kv_cache_fraction}; 0.5 is a reasonable start")
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")

    bytes_per_block = tokens_per_block * bytes_per_token
    cross_budget = int(budget_bytes * cross_kv_cache_fraction)
    self_budget = max(0, int(budget_bytes) - cross_budget)
    num_cross_blocks = cross_budget // bytes_per_block
    num_self_blocks = self_budget // bytes_per_block

    for pool, num_blocks, pool_budget, fix in (
            ("cross-attention", num_cross_blocks, cross_budget, "raise cross_kv_cache_fraction"),
            ("self-attention", num_self_blocks, self_budget, "lower cross_kv_cache_fraction")):
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: {format_bytes(max(0, int(budget_bytes)))} with "
                f"cross_kv_cache_fraction={cross_kv_cache_fraction} leaves the {pool} pool "
                f"{pool_budget} bytes, less than one block of {bytes_per_block} bytes "
                f"({tokens_per_block} tokens x {bytes_per_token} bytes). Raise "
                f"free_gpu_memory_fraction (or free GPU memory), {fix}, or lower tokens_per_block.")

    return KvPoolPlan(
        num_self_blocks=num_self_blocks, num_cross_blocks=num_cross_blocks,
        tokens_per_block=tokens_per_block, bytes_per_block=bytes_per_block,
        self_bytes=num_self_blocks * bytes_per_block,
        cross_bytes=num_cross_blocks * bytes_per_block)
