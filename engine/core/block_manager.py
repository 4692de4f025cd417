"""Paged KV block accounting: a free list plus reference counts.

Pure Python (no torch): the scheduler owns two pools, one for self-attention blocks
(grown a token at a time) and one for cross-attention blocks (written once per request
at admission). Block ids index the first dimension of the model runner's cache tensors.

Reference counts exist so that beams or parallel samples can share blocks later
(``fork``); a block returns to the free list only when its last holder frees it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

# Fragments a run-preferring ``allocate`` moves to the back of the free list before it gives
# up on a run and takes the blocks in the free list's order.
MAX_RUN_ROTATIONS = 8


class BlockAllocationError(RuntimeError):
    """``allocate`` was called without a successful ``can_allocate``: a scheduler bug."""


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks that hold ``num_tokens`` positions (ceil division; 0 tokens need 0 blocks)."""
    assert num_tokens >= 0 and tokens_per_block > 0, (num_tokens, tokens_per_block)
    return -(-num_tokens // tokens_per_block)


def slot_ids(block_ids: list[int], start: int, count: int, tokens_per_block: int) -> list[int]:
    """Cache slots of positions ``start .. start + count - 1`` of a sequence holding ``block_ids``
    (slot ``s`` is block ``s // tokens_per_block``, offset ``s % tokens_per_block``)."""
    return [block_ids[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
            for p in range(start, start + count)]


class BlockPool:
    """``num_blocks`` blocks, each free or held by one or more owners."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        # The most recently freed blocks are handed out first. A CPU pool is mapped lazily, so
        # the engine then touches only the pages of its high-water mark, and they are still in
        # cache; FIFO reuse walked the whole pool (a CPU engine's RSS grew by 12 MB every 8
        # flan-t5-small requests toward its 4 GiB budget, docs/benchmarks.md session 40). A
        # request's freed blocks come back at the front in their order, so a run stays a run.
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._peak_used = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks held at once since the pool was made or ``reset_peak`` last ran. Kept
        here because a reader that polls ``num_used_blocks`` misses requests shorter than its
        interval (a small model's whole request can be)."""
        return self._peak_used

    def reset_peak(self) -> None:
        self._peak_used = self.num_used_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, prefer_run: bool = False) -> list[int]:
        """Take ``num_blocks`` free blocks, each with reference count 1. ``prefer_run``: consecutive
        ids when the front of the free list reaches a run of them (see ``_rotate_to_run``)."""
        if not self.can_allocate(num_blocks):
            raise BlockAllocationError(
                f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} of "
                f"{self.num_total_blocks} free (call can_allocate first)")
        if prefer_run and num_blocks > 1:
            self._rotate_to_run(num_blocks)
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        used = len(self._ref_counts) - len(self._free)
        if used > self._peak_used:
            self._peak_used = used
        return block_ids

    def _rotate_to_run(self, num_blocks: int) -> None:
        """Move short runs of consecutive ids from the front of the free list to its back until
        the first ``num_blocks`` are one run (at most ``MAX_RUN_ROTATIONS`` moves).

        Cross-attention blocks are taken and freed a request at a time, so the free list is
        mostly whole runs; but once one allocation straddles two of them (requests of other sizes,
        or a pool whose size is not a multiple of the request's), reuse in order can keep later
        ones straddling. A request
        whose blocks are one run is read by the torch backend as a view of the pool, where
        scattered blocks are gathered into a copy at every layer of every step (a Whisper clip:
        3 MB per layer)."""
        free = self._free
        for _ in range(MAX_RUN_ROTATIONS):
            first, length = free[0], 1
            while length < num_blocks and free[length] == first + length:
                length += 1
            if length == num_blocks:
                return
            free.rotate(-length)

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """Share held blocks with one more owner; each owner frees its own reference."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"fork of free block {block_id}"
            self._ref_counts[block_id] += 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the front of the free
        list, in the order given."""
        released = []
        try:
            for block_id in block_ids:
                assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
                self._ref_counts[block_id] -= 1
                if self._ref_counts[block_id] == 0:
                    released.append(block_id)
        finally:
            self._free.extendleft(reversed(released))
