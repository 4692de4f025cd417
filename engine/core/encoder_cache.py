"""Cross-attention blocks kept after their request finished, for a later request with the same
encoder input: that request decodes from them and skips the encoder.

Pure Python (no torch). A caller names an encoder input with ``Request.encoder_cache_key``
(the prompt's ``multi_modal_uuids``); the key is the caller's promise that equal keys mean equal
inputs. Whisper's temperature fallback decodes a window again from the same audio: with a key,
the retry costs only its decode.

An entry holds one reference to each of its blocks, taken over from the request that wrote
them when it finished (never from an aborted one: its encoder step may not have run). The
blocks are never written again while any holder lives (the cross pool is written only when a
request is encoded), so a hit reads exactly what the first request read. Entries are evicted
oldest-used first, past ``max_entries`` or when admission needs their blocks.
"""
from __future__ import annotations

from collections import OrderedDict

from enc2dec.engine.core.block_manager import BlockPool

DEFAULT_MAX_ENTRIES = 32


class EncoderCache:
    def __init__(self, pool: BlockPool, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.pool = pool
        self.max_entries = max_entries
        self._entries: OrderedDict[str, list[int]] = OrderedDict()   # key -> block ids, oldest use first
        self.num_hits = 0          # since start, for metrics and tests

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str | None) -> bool:
        return key is not None and key in self._entries

    def share(self, key: str) -> list[int]:
        """A new reference to the blocks cached under ``key`` (which must be present), for a request
        that decodes from them; the entry becomes the most recently used."""
        self._entries.move_to_end(key)
        self.num_hits += 1
        return self.pool.fork(self._entries[key])

    def keep(self, key: str, block_ids: list[int]) -> None:
        """Take over a finished request's reference to ``block_ids``. An entry already under
        ``key`` stays (the two hold the same input) and this reference is dropped."""
        if key in self._entries or self.max_entries == 0:
            self.pool.free(block_ids)
            return
        self._entries[key] = block_ids
        while len(self._entries) > self.max_entries:
            self.evict_oldest()

    def evict_oldest(self) -> None:
        _, block_ids = self._entries.popitem(last=False)
        self.pool.free(block_ids)        # blocks a running hit still holds stay with it

    def num_evictable_blocks(self) -> int:
        """Blocks that evicting every entry would free: those no running request shares."""
        return sum(self.pool.ref_count(b) == 1 for ids in self._entries.values() for b in ids)

    def make_room(self, num_blocks: int) -> None:
        """Evict entries, oldest use first, until ``num_blocks`` can be allocated or none is left."""
        while self._entries and not self.pool.can_allocate(num_blocks):
            self.evict_oldest()
