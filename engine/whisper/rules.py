"""Whisper decoding rules as logits processors (``SamplingParams.logits_processors``).

Each is called as ``fn(output_token_ids, logits_row)`` and edits the ``[vocab]`` row in
place. They are plain picklable objects and never read a tensor back to the host: a step
with them costs a few small kernels per row. Only ``TimestampRules`` reads the token ids
(the sampler copies them to the host each step for it); the others need only their count.

- ``DetectLanguage``: the first output token is restricted to the language tokens (language
  identification as one decoder step from ``<|startoftranscript|>``), the next ones are forced
  (task, ``<|notimestamps|>``). Fusing detection into the first window saves a second
  encoder pass.
- ``SuppressAtBegin``: the checkpoint's ``begin_suppress_tokens`` at the first text
  position, for when forced tokens moved it past the engine's own (output position 0).
- ``TimestampRules``: Whisper's timestamp grammar, as the original decoder applies it.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _keep_only(row: torch.Tensor, index: torch.Tensor) -> None:
    # row: [V]; index: [K] on row's device. Every other entry becomes -inf, the kept keep their values.
    kept = row.index_select(0, index)
    row.fill_(_NEG_INF)
    row.index_copy_(0, index, kept)


def _force(row: torch.Tensor, token_id: int) -> None:
    # A finite value even where the suppress list already put -inf (Whisper suppresses the
    # task tokens as text): the forced token is then the only choice, with probability 1.
    row.fill_(_NEG_INF)
    row[token_id] = 0.0


class DetectLanguage:
    needs_token_ids = False      # only the count: the sampler skips the per-step host copy

    def __init__(self, language_ids: list[int], forced: list[int]):
        self.language_ids = sorted(language_ids)
        self.forced = list(forced)
        self._index: torch.Tensor | None = None     # language ids on the logits' device, made once

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        n = len(output_ids)
        if n == 0:
            if self._index is None or self._index.device != row.device:
                self._index = torch.tensor(self.language_ids, device=row.device)
            _keep_only(row, self._index)
        elif n <= len(self.forced):
            _force(row, self.forced[n - 1])


class SuppressAtBegin:
    needs_token_ids = False

    def __init__(self, begin_index: int, token_ids: tuple[int, ...]):
        self.begin_index = begin_index
        self.token_ids = list(token_ids)

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        if len(output_ids) == self.begin_index and self.token_ids:
            row[self.token_ids] = _NEG_INF


class TimestampRules:
    """Text between timestamp tokens, from output position ``begin_index`` on:

    - the text starts with a timestamp, at most ``max_initial_timestamp_index`` steps in;
    - timestamps come in pairs (end of one segment, start of the next) except for the last,
      never three in a row, and never decrease;
    - a lone timestamp is followed by another or by EOT, not by text;
    - when the timestamps together are likelier than the best text token, one is taken.
    """

    def __init__(self, begin_index: int, eot: int, no_timestamps: int, timestamp_begin: int,
                 max_initial_timestamp_index: int | None = 50):
        self.begin_index = begin_index
        self.eot = eot
        self.no_timestamps = no_timestamps
        self.ts = timestamp_begin
        self.max_initial = max_initial_timestamp_index

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        if len(output_ids) < self.begin_index:
            return
        seq = output_ids[self.begin_index:]
        ts = self.ts
        row[self.no_timestamps] = _NEG_INF
        last_is_ts = len(seq) >= 1 and seq[-1] >= ts
        penultimate_is_ts = len(seq) < 2 or seq[-2] >= ts
        if last_is_ts:
            if penultimate_is_ts:
                row[ts:] = _NEG_INF          # a pair just closed: text (or EOT) must follow
            else:
                row[:self.eot] = _NEG_INF    # a lone timestamp: another one or EOT
        last_stamp = next((t for t in reversed(seq) if t >= ts), None)
        if last_stamp is not None:
            # Never go back in time; a segment may end where it started only right after a lone stamp.
            floor = last_stamp if last_is_ts and not penultimate_is_ts else last_stamp + 1
            row[ts:floor] = _NEG_INF
        if not seq:
            row[:ts] = _NEG_INF
            if self.max_initial is not None:
                row[ts + self.max_initial + 1:] = _NEG_INF
        # Compared in logits, not log-probs: the softmax normaliser is the same on both sides.
        timestamp_mass = row[ts:].logsumexp(dim=-1)
        best_text = row[:ts].max()
        row[:ts].masked_fill_(timestamp_mass > best_text, _NEG_INF)
