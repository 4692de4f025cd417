"""Each sequence's output ids in one device buffer, for the rules that read them (Whisper's
timestamp grammar) without a host copy.

The sampler writes every chosen token of a sequence that has such a rule at its output
position, as one scatter per step; the rules gather the rows they need. The host decides
which slot and which position, from counts it already knows, so nothing here waits for the
device and a sequence's history survives preemption (its tokens do not change).
"""
from __future__ import annotations

import torch

from enc2dec.engine.runner.host_to_device import to_device


class TokenHistory:
    def __init__(self, device: torch.device, num_slots: int = 64, max_len: int = 512):
        self.device = device
        self._ids = torch.full((num_slots, max_len), -1, dtype=torch.long, device=device)   # [slots, L]
        self._slot: dict[int, int] = {}           # seq_id -> row of _ids
        self._free = list(range(num_slots - 1, -1, -1))

    def slots(self, seq_ids: list[int], max_position: int) -> list[int]:
        """The rows of ``seq_ids`` (new ones get a fresh row), with room for ``max_position``."""
        if max_position >= self._ids.shape[1]:
            self._grow(self._ids.shape[0], max(2 * self._ids.shape[1], max_position + 1))
        out = []
        for seq_id in seq_ids:
            slot = self._slot.get(seq_id)
            if slot is None:
                if not self._free:
                    self._grow(2 * self._ids.shape[0], self._ids.shape[1])
                slot = self._slot[seq_id] = self._free.pop()
                self._ids[slot].fill_(-1)
            out.append(slot)
        return out

    def window(self, slots: list[int]) -> torch.Tensor:
        """The ids of ``slots`` [R, L] (-1 where nothing was written)."""
        return self._ids.index_select(0, to_device(slots, torch.long, self.device))

    def record(self, slots: list[int], positions: list[int], token_ids: torch.Tensor) -> None:
        # token_ids: [R] on the device, the token each slot chose at its output position
        index = to_device((slots, positions), torch.long, self.device)     # one staged copy: [2, R]
        self._ids.index_put_((index[0], index[1]), token_ids)

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            slot = self._slot.pop(seq_id, None)
            if slot is not None:
                self._free.append(slot)

    def _grow(self, num_slots: int, max_len: int) -> None:
        # A device copy into a larger buffer: rare (doubling), and no sync.
        ids = torch.full((num_slots, max_len), -1, dtype=torch.long, device=self.device)
        old = self._ids
        ids[:old.shape[0], :old.shape[1]] = old
        self._free = list(range(num_slots - 1, old.shape[0] - 1, -1)) + self._free
        self._ids = ids
