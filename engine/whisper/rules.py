"""Whisper decoding rules as logits processors (``SamplingParams.logits_processors``).

Each is a plain picklable object with two forms of one rule:

- ``apply_batch`` (``batched = True``): what the sampler runs, for all rows holding the rule
  at once, as tensor work on the device. Per-row parameters and counts come from the host,
  which knows them; the one thing it does not know under the overlap scheduler, the token
  the previous step just chose, is read from the device-side ``TokenHistory``. So a Whisper
  request with timestamps or language detection never makes a step wait for the GPU. Beam
  rows, which reorder every step, pass a window staged from their host ids instead. It
  returns a fresh tensor or its input unchanged, never editing the input in place: the
  sampler may hand it the model's own logits.
- ``__call__(output_token_ids, logits_row)``: the same rule on one row with the ids on the
  host: the readable reference the tests hold ``apply_batch`` to.

The rules:

- ``DetectLanguage``: the first output token is restricted to the language tokens (language
  identification as one decoder step from ``<|startoftranscript|>``), the next ones are forced
  (task, ``<|notimestamps|>``). Fusing detection into the first window saves a second
  encoder pass.
- ``SuppressAtBegin``: the checkpoint's ``begin_suppress_tokens`` at the first text
  position, for when forced tokens moved it past the engine's own (output position 0).
- ``TimestampRules``: Whisper's timestamp grammar, as the original decoder applies it.

Batched rules run before any Python processor of the row, in ``order``.
"""
from __future__ import annotations

import functools

import torch

from enc2dec.engine.runner.host_to_device import to_device

_NEG_INF = float("-inf")
_BIG = 1 << 40        # "no bound" for an int64 rule parameter


@functools.lru_cache(maxsize=16)
def _allowed(ids: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """[V] bool, True at ``ids``: made once per id set and device."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[to_device(list(ids), torch.long, device)] = True
    return mask


@functools.cache
def _neg_inf(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((), _NEG_INF, dtype=dtype, device=device)     # a fill kernel: torch.tensor() would copy and wait


@functools.lru_cache(maxsize=16)
def _tail_columns(special: int, vocab: int, ts: int, no_ts: int, eot: int, device: torch.device):
    """The ids [special, vocab) as [1, W] and, as [1, W] bool, which are text, <|notimestamps|>, EOT."""
    cols = torch.arange(special, vocab, device=device)[None, :]
    return cols, cols < ts, cols == no_ts, cols == eot


def _columns(vocab: int, device: torch.device) -> torch.Tensor:
    return torch.arange(vocab, device=device)[None, :]         # [1, V]


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
    needs_token_ids = False      # only the count
    batched = True
    order = 0

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

    @staticmethod
    def apply_batch(logits: torch.Tensor, rules: list["DetectLanguage"], num_output_tokens: list[int],
                    history=None) -> torch.Tensor:
        # logits: [R, V]; rows at output 0 keep only their language ids, the next ones are forced
        dev, vocab = logits.device, logits.shape[-1]
        detecting = [i for i, n in enumerate(num_output_tokens) if n == 0]
        for ids in {tuple(rules[i].language_ids) for i in detecting}:      # one set per model
            rows = to_device([n == 0 and tuple(r.language_ids) == ids for r, n in zip(rules, num_output_tokens)],
                             torch.bool, dev)[:, None]                                      # [R, 1]
            logits = logits.masked_fill(rows & ~_allowed(ids, vocab, dev)[None, :], _NEG_INF)
        forced = [r.forced[n - 1] if 1 <= n <= len(r.forced) else -1 for r, n in zip(rules, num_output_tokens)]
        if any(t >= 0 for t in forced):
            token = to_device(forced, torch.long, dev)[:, None]                             # [R, 1]
            logits = torch.where(token >= 0, torch.where(_columns(vocab, dev) == token, 0.0, _NEG_INF), logits)
        return logits


class SuppressAtBegin:
    needs_token_ids = False
    batched = True
    order = 1

    def __init__(self, begin_index: int, token_ids: tuple[int, ...]):
        self.begin_index = begin_index
        self.token_ids = list(token_ids)

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        if len(output_ids) == self.begin_index and self.token_ids:
            row[self.token_ids] = _NEG_INF

    @staticmethod
    def apply_batch(logits: torch.Tensor, rules: list["SuppressAtBegin"], num_output_tokens: list[int],
                    history=None) -> torch.Tensor:
        # logits: [R, V]; one staged (row, token) index list for the rows at their begin index
        rows, cols = [], []
        for i, (r, n) in enumerate(zip(rules, num_output_tokens)):
            if n == r.begin_index:
                rows += [i] * len(r.token_ids)
                cols += r.token_ids
        if not rows:
            return logits
        dev = logits.device
        index = to_device((rows, cols), torch.long, dev)
        return logits.index_put((index[0], index[1]), torch.full((), _NEG_INF, device=dev))


class TimestampRules:
    """Text between timestamp tokens, from output position ``begin_index`` on:

    - the text starts with a timestamp, at most ``max_initial_timestamp_index`` steps in;
    - timestamps come in pairs (end of one segment, start of the next) except for the last,
      never three in a row, and never decrease;
    - a lone timestamp is followed by another or by EOT, not by text;
    - when the timestamps together are likelier than the best text token, one is taken.

    ``open_segment_at``: a timestamp token that the hidden decoder prompt already opened a
    segment with, followed by text (a forced prefix): the output continues that segment.
    ``end_not_before``: a timestamp token; once there is text, EOT waits until a timestamp at or
    after it (Whisper closes some windows with words left unheard; this makes it go on).
    """

    needs_token_ids = True       # the per-row form; the batched one reads the device-side history
    batched = True
    reads_history = True
    order = 2

    def __init__(self, begin_index: int, eot: int, no_timestamps: int, timestamp_begin: int,
                 max_initial_timestamp_index: int | None = 50, open_segment_at: int | None = None,
                 end_not_before: int | None = None):
        self.begin_index = begin_index
        self.eot = eot
        self.no_timestamps = no_timestamps
        self.ts = timestamp_begin
        self.max_initial = max_initial_timestamp_index
        self.open_segment_at = open_segment_at
        self.end_not_before = end_not_before

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        if len(output_ids) < self.begin_index:
            return
        seq = output_ids[self.begin_index:]
        if self.open_segment_at is not None:
            seq = [self.open_segment_at, 0, *seq]      # the opening stamp and (any) text of the prompt
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
        if self.end_not_before is not None and (last_stamp is None or last_stamp < self.end_not_before) \
                and any(t < self.eot for t in seq):
            row[self.eot] = _NEG_INF
        # Compared in logits, not log-probs: the softmax normaliser is the same on both sides.
        timestamp_mass = row[ts:].logsumexp(dim=-1)
        best_text = row[:ts].max()
        row[:ts].masked_fill_(timestamp_mass > best_text, _NEG_INF)

    @staticmethod
    def apply_batch(logits: torch.Tensor, rules: list["TimestampRules"], num_output_tokens: list[int],
                    history: torch.Tensor) -> torch.Tensor:
        """``__call__``'s grammar for R rows at once. ``history`` [R, L] holds each row's output
        ids (its last one possibly written by the step still on the GPU).

        Each rule bans a column range per row, so the work is a few [R, 1] bounds, small ops on
        the special ids and timestamps, and over the ordinary words, which a row bans all or
        none of, one read (their best) and one write: a CPU decode step is bound by the
        full-vocabulary passes, and this form has two, not twenty."""
        # logits: [R, V] float32
        dev = logits.device
        eot, no_ts, ts = rules[0].eot, rules[0].no_timestamps, rules[0].ts
        if any((r.eot, r.no_timestamps, r.ts) != (eot, no_ts, ts) for r in rules):
            raise ValueError("TimestampRules.apply_batch: the rows' rules must share one tokenizer's ids")
        special = min(eot, no_ts)         # [0, special): the words; [special, ts): EOT, <|notimestamps|>, ...
        if not 0 < special or max(eot, no_ts) >= ts:
            raise ValueError(f"TimestampRules.apply_batch: eot ({eot}) and no_timestamps ({no_ts}) must be "
                             f"text ids above 0 and below timestamp_begin ({ts})")
        # Per row, all known on the host: output count, begin index, last allowed first timestamp, the
        # prompt's open segment stamp (-1: none), the end_not_before stamp (-1: none), where the last
        # two output ids are, and flags: the rule is on; the output opens with a stamp; there is a
        # last id; a penultimate one; the penultimate counts as a stamp whatever it is (none, or
        # before the output without an open segment); an open segment. One staged copy.
        rows = []
        for r, n in zip(rules, num_output_tokens):
            num_seq, opened = n - r.begin_index, r.open_segment_at is not None      # text tokens so far
            rows.append([n, r.begin_index, r.ts + r.max_initial if r.max_initial is not None else _BIG,
                         r.open_segment_at if opened else -1, -1 if r.end_not_before is None else r.end_not_before,
                         max(n - 1, 0), max(n - 2, 0), num_seq >= 0, num_seq == 0 and not opened, num_seq >= 1,
                         num_seq >= 2, num_seq < 2 and not opened, opened])
        p = to_device(rows, torch.long, dev)                                                      # [R, 13]
        n, begin, last_initial, open_at, end_from = (p[:, i:i + 1] for i in range(5))
        flags = p[:, 7:] > 0
        on, first, has_last, has_penultimate, penultimate_forced, opened = (flags[:, i:i + 1] for i in range(6))
        last_two_ts = history.gather(1, p[:, 5:7]) >= ts                                         # [R, 2]
        last_is_ts = has_last & last_two_ts[:, :1]
        # An open segment puts a stamp and text before the output: one token in, the one before is text.
        penultimate_is_ts = (has_penultimate & last_two_ts[:, 1:]) | penultimate_forced
        positions = torch.arange(history.shape[1], device=dev)[None, :]                            # [1, L]
        # The output ids from the begin index on, EOT (neither text nor a stamp) elsewhere.
        seq = torch.where((positions >= begin) & (positions < n), history, eot)                   # [R, L]
        # Timestamps never decrease, so the last one is the largest.
        latest = seq.amax(dim=1, keepdim=True)
        last_stamp = torch.maximum(torch.where(latest >= ts, latest, -1), open_at)                # [R, 1]
        lone = last_is_ts & ~penultimate_is_ts                        # another stamp, or EOT
        closed = last_is_ts & penultimate_is_ts                       # a pair just closed: no stamp
        has_text = opened | (seq < eot).any(dim=1, keepdim=True)                                  # [R, 1]
        hold_eot = on & has_text & (last_stamp < end_from)
        # Text columns [0, ts) are banned below a bound: all of them first, those below EOT after a
        # lone stamp; so the words [0, special) go all or none (special <= EOT).
        text_bound = torch.where(first, ts, torch.where(lone, eot, 0))
        words_banned = first | lone                                                                # [R, 1]
        # Timestamp columns [ts, V): a window [low, high] of stamps stays (never back in time; at
        # most the initial bound first; none right after a closed pair).
        floor = torch.where(lone, last_stamp, last_stamp + 1)
        low = torch.where(closed, _BIG, torch.where(on & (last_stamp >= 0), floor, ts))
        high = torch.where(first, last_initial, _BIG)
        # The special ids and the stamps [special, V), banned column by column: a small block.
        cols, is_text, is_no_ts, is_eot = _tail_columns(special, logits.shape[-1], ts, no_ts, eot, dev)
        banned = torch.where(is_text, cols < text_bound, (cols < low) | (cols > high)) \
            | (is_no_ts & on) | (is_eot & hold_eot)                                                # [R, V - special]
        tail = logits[:, special:].masked_fill(banned, _NEG_INF)                                   # [R, V - special]
        specials, stamps = tail[:, :ts - special], tail[:, ts - special:]
        # Compared in logits, not log-probs: the softmax normaliser is the same on both sides.
        timestamp_mass = stamps.logsumexp(dim=-1, keepdim=True)                                   # [R, 1]
        best_word = logits[:, :special].amax(dim=-1, keepdim=True).masked_fill(words_banned, _NEG_INF)
        best_text = torch.maximum(best_word, specials.amax(dim=-1, keepdim=True))
        no_text = on & (timestamp_mass > best_text)
        out = torch.empty_like(logits)                                                             # [R, V]
        torch.where(words_banned | no_text, _neg_inf(dev, logits.dtype), logits[:, :special], out=out[:, :special])
        out[:, special:ts] = specials.masked_fill(no_text, _NEG_INF)
        out[:, ts:] = stamps
        return out
