"""Token selection for one decoder step: logit filters, greedy / random sampling, logprobs,
and beam search candidates.

Per-request state (seeded streams, suppress lists) lives in ``SeqSamplingState``; the
sampler builds one batched set of tensors per step, staged through pinned memory, and
never waits for the device: no list indexing of device tensors, no ``.item()``. Greedy
rows never touch an RNG, and a seeded request draws from its own counter-based stream
(``sampling_ops``), so its tokens do not depend on which other requests share the batch.
Rules with a batched form (``batched = True``: Whisper's timestamp grammar and language
detection) run as tensor work over all their rows, reading a device-side token history;
Python logits processors, which may read token ids, remain the one slow path (their ids
arrive from the host with the step).
"""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from enc2dec.engine.runner.host_to_device import to_device
from enc2dec.engine.runner.token_history import TokenHistory
from enc2dec.engine.runner.sampling_ops import race
from enc2dec.engine.sampling_params import SamplingParams


@functools.cache
def _neg_inf(device: torch.device) -> torch.Tensor:
    return torch.full((), float("-inf"), device=device)     # a fill kernel: torch.tensor() would copy and wait


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's likeliest id, the first on a tie (and a NaN's, as argmax). On the CPU ``max``'s
    indices, not ``argmax``: the same choice, but the CPU's argmax kernel is scalar (over
    Whisper's 51,864 ids at one row, 2 cores: 72 us against 26 us). On a GPU the two are one
    reduction; argmax stays, the kernel the GPU parity runs were measured with."""
    # logits: [S, V] -> [S] int64
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)


@functools.lru_cache(maxsize=256)
def _interned(ids: tuple[int, ...]) -> tuple[int, ...]:
    """One object per distinct id set (the first seen), so a batch tells rows that mask the same
    ids apart by identity, without comparing their ~90 ids row by row."""
    return ids


@functools.lru_cache(maxsize=16)
def _mask_columns(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return to_device(list(ids), torch.long, device)                 # [K], staged once per id set


@dataclass
class SeqSamplingState:
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    suppress_token_ids: tuple[int, ...] = ()          # always masked (Whisper generation config)
    begin_suppress_token_ids: tuple[int, ...] = ()    # masked at the first generated position
    stream: tuple[int, int] | None = None             # seeded rows: sampling_ops.stream_key
    prefix_token_ids: tuple[int, ...] = ()            # the hidden decoder prefix (repetition_penalty sees it)
    min_tokens_mask_ids: tuple[int, ...] = field(default=())
    masked_ids: tuple[int, ...] = field(default=())   # suppress list and bad_token_ids
    # Its chosen tokens go into the device-side history (penalties, history-reading rules).
    records_history: bool = field(default=False)
    # Greedy with nothing to edit, record or report: its row is a bare argmax. A batch of only
    # such rows (the common serving case) skips every per-row scan of the general path.
    plain_greedy: bool = field(default=False)
    # Greedy whose logits only masks edit (suppress lists, begin-suppress, min_tokens, bad words):
    # its id is the argmax over the ids no mask removes, which runner/greedy_head.py finds too.
    masked_greedy: bool = field(default=False)
    # As plain_greedy, but the row may draw at random: the step needs only the choice.
    simple: bool = field(default=False)
    is_random: bool = field(default=False)            # draws (not greedy, not beam search)
    has_filters: bool = field(default=False)          # top-k, top-p or min-p cut its distribution
    float_params: tuple[float, float, float] = field(default=(1.0, 1.0, 0.0))   # temperature, top_p, min_p
    top_k: int = field(default=0)                     # 0: off

    def __post_init__(self):
        # Decided once per request, not in every step.
        p = self.params
        self.min_tokens_mask_ids = tuple(sorted(set(self.eos_token_ids) | set(self.stop_token_ids)))
        self.masked_ids = _interned(tuple(sorted(set(self.suppress_token_ids) | set(p.bad_token_ids or ()))))
        self.records_history = not p.use_beam_search and (p.has_penalties or any(
            getattr(fn, "batched", False) and getattr(fn, "reads_history", False) for fn in p.logits_processors or ()))
        self.masked_greedy = (p.is_greedy and not p.logits_processors and not p.logit_bias and not p.has_penalties
                              and p.logprobs is None and not p.prefix_logprob_token_ids)
        self.plain_greedy = (self.masked_greedy and not self.masked_ids and not self.begin_suppress_token_ids
                             and (p.min_tokens == 0 or p.ignore_eos))
        self.is_random = not (p.is_greedy or p.use_beam_search)
        self.simple = self.is_random and not p.logits_processors and not p.logit_bias and not p.has_penalties \
            and not self.masked_ids and not self.begin_suppress_token_ids and (p.min_tokens == 0 or p.ignore_eos) \
            and p.logprobs is None and not p.prefix_logprob_token_ids or self.plain_greedy
        self.has_filters = bool(p.top_k or p.top_p not in (None, 1.0) or p.min_p)
        self.float_params = (p.temperature if p.temperature is not None else 1.0,
                             p.top_p if p.top_p is not None else 1.0, p.min_p or 0.0)
        self.top_k = p.top_k or 0


# Per-row fields read with map(): one C-level pass over the batch, not a Python loop per row.
_PLAIN, _SIMPLE = operator.attrgetter("plain_greedy"), operator.attrgetter("simple")
_MASKED_GREEDY, _MASKED_IDS = operator.attrgetter("masked_greedy"), operator.attrgetter("masked_ids")
_IS_RANDOM, _STREAM = operator.attrgetter("is_random"), operator.attrgetter("stream")
_FLOATS, _TOP_K, _HAS_FILTERS = (operator.attrgetter(name) for name in ("float_params", "top_k", "has_filters"))


def all_plain_greedy(states: list[SeqSamplingState]) -> bool:
    """Whether every row is a bare argmax (None: a tensor-parallel worker's row, never sampled)."""
    return all(states) and all(map(_PLAIN, states))      # all(states): no None (a state is always true)


def all_simple(states: list[SeqSamplingState]) -> bool:
    """Whether every row needs only its choice (a bare argmax or a plain draw): no beams, masks,
    rules, penalties, logprobs or prefix log-probs, so a step needs nothing of the rows but
    their states and output counts."""
    return all(states) and all(map(_SIMPLE, states))


def _same_rows(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _Batch:
    """What the sampler needs to know of a step's rows, worked out once and kept while the
    batch holds the same requests in the same rows (most steps of a steady batch): a steady
    step then costs one identity pass over the rows, at C speed."""

    def __init__(self, states: list[SeqSamplingState]):
        self.states = list(states)
        self.plain = all_plain_greedy(states)
        self.masked_greedy = self.plain or (all(states) and all(map(_MASKED_GREEDY, states)))
        self.simple = self.plain or all_simple(states)
        self.drawing = list(itertools.compress(range(len(states)), map(_IS_RANDOM, states))) if all(states) \
            else [r for r, st in enumerate(states) if st is not None and st.is_random]
        self.no_logprobs = [None] * len(states)      # DeviceSample.want of a step that asks none (read only)
        self.plan: _DrawPlan | None = None           # made at the first step that draws
        self._static_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        self._static_mask_made = False
        # The ids every row masks when all rows mask the same ones (a model's suppress list: every
        # Whisper row), else None: then the mask is those columns, whatever the rows, and a batch
        # that changes at every step (a clip admitted each step) stages nothing per row.
        first = states[0].masked_ids if states and states[0] is not None else ()
        self.shared_mask_ids = first if first and all(states) and all(
            map(operator.is_, map(_MASKED_IDS, states), itertools.repeat(first))) else None
        # Rows whose mask changes with their output count (begin-suppress, min_tokens).
        self.counted_mask_rows = [r for r, st in enumerate(states) if st is not None and (
            st.begin_suppress_token_ids or (st.params.min_tokens and not st.params.ignore_eos))]

    def static_mask(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) on ``device`` of every row's ``masked_ids`` (suppress list, bad words):
        staged once for the batch, not rebuilt from Python lists at every step (Whisper's
        ~90 suppressed ids per row were 4% of a CPU decode step)."""
        if not self._static_mask_made:
            rows, cols = _static_mask_indices(self.states)
            self._static_mask = tuple(to_device((rows, cols), torch.long, device)) if rows else None
            self._static_mask_made = True
        return self._static_mask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None               # of the chosen token, per row
    top_logprobs: list[dict[int, float]] | None = None
    # Per beam group: (parent row within the group, token id, cumulative logprob, token logprob), best first.
    beams: list[list[tuple[int, int, float, float]]] | None = None
    prefix_logprobs: dict[int, dict[int, float]] | None = None    # row -> SamplingParams.prefix_logprob_token_ids


@dataclass(frozen=True)
class BeamGroup:
    """The running beams of one beam-search request: rows ``start .. start + num_rows - 1``."""

    start: int
    num_rows: int
    num_keep: int        # candidates to propose: transformers keeps max(2, 1 + #stop ids) * width


@dataclass
class BeamCandidates:
    """Per group, the best ``num_keep`` continuations over its beams (padded to the widest group)."""

    cumulative_logprobs: torch.Tensor   # [G, keep] float32, descending
    parent_rows: torch.Tensor           # [G, keep] int64, row within the group
    token_ids: torch.Tensor             # [G, keep] int64
    logprobs: torch.Tensor              # [G, keep] float32, the token's own log-probability
    num_keep: list[int]

    def to(self, device, non_blocking: bool = False) -> "BeamCandidates":
        return BeamCandidates(*(t.to(device, non_blocking=non_blocking) for t in (
            self.cumulative_logprobs, self.parent_rows, self.token_ids, self.logprobs)), self.num_keep)

    def output(self) -> list[list[tuple[int, int, float, float]]]:
        cols = [t.tolist() for t in (self.parent_rows, self.token_ids, self.cumulative_logprobs, self.logprobs)]
        return [list(zip(*(c[g][:keep] for c in cols))) for g, keep in enumerate(self.num_keep)]


def _counted_mask_indices(states: list[SeqSamplingState], num_output_tokens: list[int], candidates: list[int]):
    """The part of ``_mask_indices`` that depends on the output count, for the ``candidates`` rows."""
    rows, cols = [], []
    for r in candidates:
        st, n_out = states[r], num_output_tokens[r]
        ids = list(st.begin_suppress_token_ids) if n_out == 0 else []
        if n_out < st.params.min_tokens and not st.params.ignore_eos:
            ids += st.min_tokens_mask_ids
        rows += [r] * len(ids)
        cols += ids
    return rows, cols


def _static_mask_indices(states: list[SeqSamplingState]):
    """Every row's ``masked_ids`` (suppress list, bad words): the part of the mask that never changes."""
    return [r for r, st in enumerate(states) for _ in st.masked_ids], [i for st in states for i in st.masked_ids]


def _mask_indices(states: list[SeqSamplingState], num_output_tokens: list[int]):
    rows, cols = _static_mask_indices(states)
    counted_rows, counted_cols = _counted_mask_indices(states, num_output_tokens, range(len(states)))
    return rows + counted_rows, cols + counted_cols


@dataclass
class DeviceSample:
    """A step's choices, still on the device; ``to_host`` turns them into a SamplerOutput."""

    token_ids: torch.Tensor                     # [S] int64
    want: list[int | None]                      # logprobs asked per row
    chosen_logprobs: torch.Tensor | None = None  # [S]
    top_ids: torch.Tensor | None = None         # [S, k]
    top_vals: torch.Tensor | None = None
    beams: BeamCandidates | None = None
    prefix_rows: list[tuple[int, list[int]]] = field(default_factory=list)   # (row, token ids asked)
    prefix_vals: torch.Tensor | None = None     # [len(prefix_rows), max ids] their log-probabilities

    def to_host(self, non_blocking: bool = False) -> "DeviceSample":
        """Start the device-to-host copies (pinned, asynchronous when ``non_blocking``)."""
        move = (lambda t: None if t is None else t.to("cpu", non_blocking=non_blocking))
        return DeviceSample(move(self.token_ids), self.want, move(self.chosen_logprobs),
                            move(self.top_ids), move(self.top_vals),
                            self.beams and self.beams.to("cpu", non_blocking=non_blocking),
                            self.prefix_rows, move(self.prefix_vals))

    def output(self) -> SamplerOutput:
        out = self._tokens()
        out.beams = self.beams.output() if self.beams is not None else None
        if self.prefix_rows:
            vals = self.prefix_vals.tolist()
            out.prefix_logprobs = {row: dict(zip(ids, vals[i])) for i, (row, ids) in enumerate(self.prefix_rows)}
        return out

    def _tokens(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        if self.chosen_logprobs is None:
            return SamplerOutput(token_ids)
        lps = self.chosen_logprobs.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        tops: list[dict[int, float] | None] = []
        for r, w in enumerate(self.want):
            if w is None:
                tops.append(None)
                continue
            top = dict(zip(ids[r][:w], vals[r][:w])) if w and ids is not None else {}
            top[token_ids[r]] = lps[r]
            tops.append(top)
        return SamplerOutput(token_ids, lps, tops)


def _apply_logits_processors(logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: list[int],
                             rows: list[int], histories: list[list[int] | None], owned: bool) -> torch.Tensor:
    # logits: [S, V]. Never edit the model's (or a CUDA graph's) output buffer in place.
    if not owned:
        logits = logits.clone()
    for r in rows:
        # Processors that read only the count get -1s: no ids were sent for them.
        ids = histories[r] if histories[r] is not None else [-1] * num_output_tokens[r]
        for fn in _row_processors(states[r]):
            fn(ids, logits[r])
    return logits


def _row_processors(st: SeqSamplingState) -> list:
    """The Python processors that run row by row (the batched rules run in ``_choose``)."""
    return [fn for fn in st.params.logits_processors or () if not getattr(fn, "batched", False)]


def _group_rules(states: list[SeqSamplingState], rows) -> dict[type, tuple[list[int], list]]:
    """The rules of ``rows`` that the sampler applies batched (``batched = True``), by rule
    class: ``{cls: (rows, rule objects)}``."""
    by_rule: dict[type, tuple[list[int], list]] = {}
    for r in rows:
        for fn in states[r].params.logits_processors or ():
            if getattr(fn, "batched", False):
                rule_rows, fns = by_rule.setdefault(type(fn), ([], []))
                rule_rows.append(r)
                fns.append(fn)
    return by_rule


def _batched_rules(states: list[SeqSamplingState]):
    """The batched rules of the rows that are not beams (``_group_rules``), and the rows whose
    chosen tokens go into the history."""
    rows = [r for r, st in enumerate(states) if not st.params.use_beam_search and st.params.logits_processors]
    return _group_rules(states, rows), [r for r, st in enumerate(states) if st.records_history]


def _apply_rules(logits: torch.Tensor, by_rule: dict[type, tuple[list[int], list]], num_output_tokens: list[int],
                 window) -> torch.Tensor:
    """Each batched rule once over all its rows, in ``order``; ``window(rows)`` gives those rows'
    output ids [R, L] for the rules that read them. Never edits ``logits`` in place."""
    # logits: [S, V]
    for rule in sorted(by_rule, key=lambda cls: cls.order):
        rule_rows, fns = by_rule[rule]
        history = window(rule_rows) if getattr(rule, "reads_history", False) else None
        counts = [num_output_tokens[r] for r in rule_rows]
        if len(rule_rows) == logits.shape[0]:          # every row (rows are distinct): no gather, no scatter
            logits = rule.apply_batch(logits, fns, counts, history)
            continue
        idx = to_device(rule_rows, torch.long, logits.device)
        logits = logits.index_copy(0, idx, rule.apply_batch(logits.index_select(0, idx), fns, counts, history))
    return logits


def _host_window(histories: list[list[int] | None], num_output_tokens: list[int]) -> np.ndarray:
    """[R, L] int64: the rows' output ids from the host, -1 past each row's count and where a
    row's ids were not sent (as the row-by-row form sees them)."""
    window = np.full((len(histories), max(1, max(num_output_tokens))), -1, np.int64)
    for i, (ids, n) in enumerate(zip(histories, num_output_tokens)):
        if ids is not None and n:
            window[i, :n] = ids
    return window


def _penalize(logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: list[int],
              rows: list[int], window: torch.Tensor) -> torch.Tensor:
    """Repetition / presence / frequency penalties for ``rows``, batched; ``window`` [R, L]
    holds those rows' output ids from the device-side history."""
    # logits: [S, V] float32 -> a fresh [S, V]
    dev = logits.device
    idx = to_device(rows, torch.long, dev)
    sub = logits.index_select(0, idx)                                                     # [R, V]
    params = [states[r].params for r in rows]
    written = torch.arange(window.shape[1], device=dev)[None, :] < \
        to_device([num_output_tokens[r] for r in rows], torch.long, dev)[:, None]         # [R, L]
    counts = torch.zeros_like(sub).scatter_add_(1, window.clamp(min=0), written.to(sub.dtype))   # [R, V]
    f = to_device([[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params],
                  torch.float32, dev)                                                     # [R, 3]
    seen = counts > 0
    prefix = [(i, t) for i, r in enumerate(rows) if params[i].repetition_penalty != 1.0
              for t in states[r].prefix_token_ids]
    repeated = seen
    if prefix:
        at = to_device(list(zip(*prefix)), torch.long, dev)
        repeated = seen.index_put((at[0], at[1]), torch.ones((), dtype=torch.bool, device=dev))
    rep = f[:, :1]
    sub = torch.where(repeated, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - f[:, 1:2] * seen - f[:, 2:3] * counts
    return logits.index_copy(0, idx, sub)


def _add_logit_bias(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Each row's ``logit_bias`` added, as one staged index list (a fresh tensor)."""
    bias = [(r, t, b) for r, st in enumerate(states) if not st.params.use_beam_search
            for t, b in (st.params.logit_bias or {}).items()]
    if not bias:
        return logits
    dev = logits.device
    at = to_device([(r, t) for r, t, _ in bias], torch.long, dev).t()
    return logits.index_put((at[0], at[1]), to_device([b for *_, b in bias], logits.dtype, dev), accumulate=True)


def _beam_candidates(logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: list[int],
                     groups: list[BeamGroup], beam_scores: list[float],
                     histories: list[list[int] | None]) -> BeamCandidates:
    """Top continuations of each group's beams by cumulative log-probability, on the device.

    As in transformers' beam search, the log-softmax is taken over the raw logits and the
    filters (suppress lists, min_tokens, then logits processors) edit the log-probabilities:
    masking does not renormalize a beam's distribution."""
    # logits: [S, V] (unfiltered); beam_scores: per row of the groups, in order; histories: per row
    dev, vocab = logits.device, logits.shape[-1]
    rows = [g.start + j for g in groups for j in range(g.num_rows)]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        picked = logits[rows[0]:rows[0] + len(rows)]                           # a view
    else:
        picked = logits.index_select(0, to_device(rows, torch.long, dev))
    logp = picked.float().log_softmax(dim=-1)                                 # [R, V], a fresh tensor
    m_rows, m_cols = _mask_indices([states[r] for r in rows], [num_output_tokens[r] for r in rows])
    if m_rows:
        logp.index_put_(tuple(to_device((m_rows, m_cols), torch.long, dev)), _neg_inf(dev))
    # Batched rules over all beams at once, each beam over its own ids: beams reorder every step,
    # so their windows come from the host lists (one staged copy), not the device-side history.
    beam_states, beam_counts = [states[r] for r in rows], [num_output_tokens[r] for r in rows]
    by_rule = _group_rules(beam_states, range(len(rows)))
    if by_rule:
        logp = _apply_rules(logp, by_rule, beam_counts, lambda rule_rows: to_device(
            _host_window([histories[rows[i]] for i in rule_rows], [beam_counts[i] for i in rule_rows]),
            torch.long, dev))
    for i, st in enumerate(beam_states):      # Python processors: row by row, after the batched rules
        for fn in _row_processors(st):
            fn(histories[rows[i]] if histories[rows[i]] is not None else [-1] * beam_counts[i], logp[i])
    scores = logp + to_device(beam_scores, torch.float32, dev)[:, None]     # [R, V]
    width = max(g.num_rows for g in groups)
    keep = max(g.num_keep for g in groups)
    # Groups side by side, each as `width` beams: [G, width * V], beam-major as transformers
    # flattens them, so the parent of flat index i is i // V and its token i % V.
    if all(g.num_rows == width for g in groups):
        # Every group at full width (the usual step): the rows already lie that way, and views
        # spare two [R, V] buffers and their copies (Whisper's 51,864 ids at 55 beam rows: 11 MB each).
        flat_scores, flat_logp = scores.view(len(groups), -1), logp.view(len(groups), -1)
    else:
        # A narrower group is padded with beams of -inf.
        slots = to_device([gi * width + j for gi, g in enumerate(groups) for j in range(g.num_rows)], torch.long, dev)
        padded = torch.full((len(groups) * width, vocab), float("-inf"), device=dev)
        flat_scores = padded.index_copy(0, slots, scores).view(len(groups), -1)
        flat_logp = padded.index_copy(0, slots, logp).view(len(groups), -1)
    top_scores, top_idx = flat_scores.topk(keep, dim=-1)                     # [G, keep]
    token_logprobs = flat_logp.gather(1, top_idx)                            # [G, keep]
    return BeamCandidates(top_scores, top_idx // vocab, top_idx % vocab, token_logprobs,
                          [g.num_keep for g in groups])


class Sampler:
    def __init__(self):
        self.history: TokenHistory | None = None      # made when a rule that reads it first appears
        self._batch: _Batch | None = None             # the last step's rows

    def release(self, seq_ids) -> None:
        """Forget finished sequences' device-side histories."""
        if self.history is not None:
            self.history.release(seq_ids)

    def batch(self, states: list[SeqSamplingState]) -> _Batch:
        """The step's rows as the sampler sees them; kept while they are the last step's."""
        batch = self._batch
        if batch is None or not _same_rows(batch.states, states):
            batch = self._batch = _Batch(states)
        return batch

    def argmax_mask(self, states: list[SeqSamplingState], num_output_tokens: list[int]):
        """For a step whose rows all want only the argmax of their masked logits (``masked_greedy``):
        ``(True, (rows, cols) or None)``, the ids each row's masks remove this step; else
        ``(False, None)``: the step needs its logits."""
        batch = self.batch(states)
        if not batch.masked_greedy:
            return False, None
        if batch.plain:
            return True, None
        static = batch.static_mask(torch.device("cpu"))            # staged once per batch
        rows, cols = _counted_mask_indices(states, num_output_tokens, batch.counted_mask_rows) \
            if batch.counted_mask_rows else ([], [])
        if not rows:
            return True, static
        counted = (torch.tensor(rows), torch.tensor(cols))
        return True, counted if static is None else tuple(torch.cat(pair) for pair in zip(static, counted))

    def choose(self, token_ids: torch.Tensor, states: list[SeqSamplingState]) -> DeviceSample:
        """Argmax rows whose ids were found without a logits tensor (runner/greedy_head.py)."""
        return DeviceSample(token_ids, self.batch(states).no_logprobs)

    def sample(self, logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: list[int],
               beam_groups: list[BeamGroup] = (), beam_scores: list[float] = (),
               histories: list[list[int] | None] | None = None, seq_ids: list[int] | None = None) -> DeviceSample:
        """Choose one token per row without waiting for the device; for ``beam_groups`` (rows of
        beam-search requests, whose chosen token is meaningless) propose candidates instead.
        ``histories``: each row's output ids where its request's Python processors read them
        (else None); ``seq_ids`` name the rows for the device-side history of batched rules."""
        # logits: [S, V] float32; num_output_tokens: tokens each row has produced so far
        batch = self.batch(states)
        if not beam_groups and batch.simple:        # the common step: only the choice
            if not batch.drawing:
                return DeviceSample(greedy(logits), batch.no_logprobs)
            # A batch that only draws needs no argmax: every row is overwritten by its draw.
            chosen = greedy(logits) if len(batch.drawing) < len(states) else None     # [S]
            return DeviceSample(self._sample(logits, chosen, batch, num_output_tokens), batch.no_logprobs)
        histories = histories if histories is not None else [None] * len(states)
        beams = None
        if beam_groups:
            beams = _beam_candidates(logits, states, num_output_tokens, list(beam_groups), list(beam_scores),
                                     histories)
        sample = self._choose(logits, batch, num_output_tokens, histories, seq_ids)
        sample.beams = beams
        return sample

    def _choose(self, logits: torch.Tensor, batch: _Batch, num_output_tokens: list[int],
                histories: list[list[int] | None], seq_ids: list[int] | None) -> DeviceSample:
        states = batch.states
        model_logits = logits      # every edit below makes a fresh tensor; this one stays as it was
        # Beam rows run every rule in _beam_candidates, over each beam's own history.
        by_rule, recorded = _batched_rules(states)
        slots = None
        if recorded:
            if seq_ids is None:
                raise ValueError("penalties and rules that read the token history need the rows' seq_ids")
            if self.history is None:
                self.history = TokenHistory(logits.device)
            slots = self.history.slots([seq_ids[r] for r in recorded], max(num_output_tokens[r] for r in recorded))
            slot_of = dict(zip(recorded, slots))
        # On the raw logits, as transformers and vLLM apply them (before temperature).
        penalized = [r for r in recorded if states[r].params.has_penalties]
        if penalized:
            logits = _penalize(logits, states, num_output_tokens, penalized,
                               self.history.window([slot_of[r] for r in penalized]))
        logits = _add_logit_bias(logits, states)
        if batch.shared_mask_ids is not None:
            logits = logits.index_fill(1, _mask_columns(batch.shared_mask_ids, logits.device), float("-inf"))
        else:
            static = batch.static_mask(logits.device)
            if static is not None:
                logits = logits.index_put(static, _neg_inf(logits.device))
        if batch.counted_mask_rows:
            rows, cols = _counted_mask_indices(states, num_output_tokens, batch.counted_mask_rows)
            if rows:
                dev = logits.device
                logits = logits.index_put(tuple(to_device((rows, cols), torch.long, dev)), _neg_inf(dev))
        if by_rule:
            logits = _apply_rules(logits, by_rule, num_output_tokens,
                                  lambda rule_rows: self.history.window([slot_of[r] for r in rule_rows]))
        processed = [r for r, st in enumerate(states) if not st.params.use_beam_search and _row_processors(st)]
        if processed:
            logits = _apply_logits_processors(logits, states, num_output_tokens, processed, histories,
                                              owned=logits is not model_logits)
        chosen = greedy(logits)                                             # [S]
        if batch.drawing:                                                   # beams: no RNG
            chosen = self._sample(logits, chosen, batch, num_output_tokens)
        if recorded:
            picked = chosen if recorded == list(range(len(states))) else \
                chosen.index_select(0, to_device(recorded, torch.long, chosen.device))
            self.history.record(slots, [num_output_tokens[r] for r in recorded], picked)
        want = [st.params.logprobs for st in states]
        if all(w is None for w in want):
            return DeviceSample(chosen, want)
        logp = logits.log_softmax(dim=-1)                                   # [S, V]
        chosen_lp = logp.gather(1, chosen[:, None])[:, 0]                   # [S]
        top = max(w or 0 for w in want)
        if top == 0:
            return DeviceSample(chosen, want, chosen_lp)
        vals, ids = logp.topk(top, dim=-1)                                  # [S, top]
        return DeviceSample(chosen, want, chosen_lp, ids, vals)

    def _sample(self, logits: torch.Tensor, chosen: torch.Tensor | None, batch: _Batch,
                num_output_tokens: list[int]) -> torch.Tensor:
        """``chosen`` with the batch's drawing rows replaced by random draws; ``chosen`` may be
        None when every row draws."""
        # logits: [S, V]; chosen: [S] int64
        dev = logits.device
        plan = batch.plan
        if plan is None or plan.dev != dev:
            plan = batch.plan = _DrawPlan(batch.states, batch.drawing, dev)
        sub = logits if plan.idx is None else logits.index_select(0, plan.idx)     # [R, V]
        keys, num_seeded = plan.keys(num_output_tokens)
        drawn = race(sub.float() / plan.divisor, keys, num_seeded, plan.filters)   # [R]
        if plan.idx is None:
            return drawn
        return chosen.index_copy(0, plan.idx, drawn)


class _DrawPlan:
    """The drawing rows' parameters on the device, staged once per batch composition (one copy
    of each kind, built with C-level passes over the rows); a step then stages only the
    seeded rows' keys, whose last word is the row's output position."""

    def __init__(self, states: list[SeqSamplingState], rows: list[int], dev: torch.device):
        self.dev, n = dev, len(rows)
        self.idx = None if n == len(states) else to_device(rows, torch.long, dev)
        self.rows = None if self.idx is None else np.asarray(rows, np.int64)
        picked = states if self.idx is None else [states[r] for r in rows]
        # One staged copy, each parameter a contiguous row padded to 16 bytes: Triton compiles a
        # kernel variant per pointer alignment, so a row starting mid-line (R % 4 != 0) would
        # compile a second one, a stall of about a second, at the first such batch size.
        cols = np.zeros((3, n + -n % 4), np.float32)
        cols[:, :n] = np.array(list(map(_FLOATS, picked)), np.float32).reshape(n, 3).T
        floats = to_device(cols, torch.float32, dev)[:, :n]                  # [3, R] of rows 16-byte aligned
        self.temperature = floats[0]                                         # [R]
        self.divisor = self.temperature[:, None]                             # [R, 1], made once
        self.filters = None
        if any(map(_HAS_FILTERS, picked)):                                   # decided on the host
            top_k = np.fromiter(map(_TOP_K, picked), np.int64, n)
            self.filters = (to_device(top_k, torch.long, dev), floats[1], floats[2], int(top_k.max()))
        # Seeded rows: their stream words, and a step's output positions beside them. Every row
        # then passes a key, so the race needs no reordering; unseeded rows beside seeded ones
        # take fresh device-drawn words, chosen by a mask staged here.
        streams = list(map(_STREAM, picked))
        self.seeded_words = None
        self.unseeded = None
        if any(streams):
            self.seeded_words = np.array([st or (0, 0) for st in streams], np.int64).reshape(n, 2)
            if not all(streams):
                self.unseeded = to_device([st is None for st in streams], torch.bool, dev)[:, None]   # [R, 1]
        self.no_keys = torch.empty(0, 3, dtype=torch.long, device=dev)

    def keys(self, num_output_tokens: list[int]) -> tuple[torch.Tensor, int]:
        """The race's keys for this step and how many rows they cover (the rest draw fresh ones)."""
        if self.seeded_words is None:
            return self.no_keys, 0
        n = self.seeded_words.shape[0]
        host = np.empty((n, 3), np.int64)
        host[:, :2] = self.seeded_words
        host[:, 2] = num_output_tokens if self.rows is None else np.asarray(num_output_tokens, np.int64)[self.rows]
        keys = to_device(host, torch.long, self.dev)                         # [R, 3]
        if self.unseeded is not None:
            keys = torch.where(self.unseeded, torch.randint(0, 1 << 32, (n, 3), device=self.dev), keys)
        return keys, n
