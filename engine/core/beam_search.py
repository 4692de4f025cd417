"""Beam search policy: which candidates keep running, which finish, when a request is done.

Pure Python (no torch). The sampler proposes, per beam-search request and step, its best
``num_keep`` continuations over all running beams, sorted by cumulative log-probability
(``BeamCandidate``); ``BeamState.step`` applies transformers' beam search rules to them
(``GenerationMixin._beam_search`` in transformers 5.x, whose results the tests compare with):

- Of the candidates, the first ``width`` that do not stop keep running, best first.
- A candidate that stops (EOS, a stop token id, or the length limit) becomes a finished
  hypothesis only if it ranks among the first ``width`` candidates; its score is
  ``cumulative_logprob / generated_len ** length_penalty`` (generated_len counts every
  output token: a forced BOS and the EOS included, the decoder start token and a Whisper
  prompt not). At most ``width`` hypotheses are kept, the best.
- ``early_stopping=True``: done once ``width`` hypotheses are kept. ``False``: done when
  the best running beam, normalized by its current length, cannot beat the worst kept
  hypothesis. ``"never"``: the same, but with a positive length penalty the running score
  is normalized by the longest possible length (``max_tokens``).
- The request is always done when every candidate stops (the length limit).

The scheduler turns the outcome into sequences: it forks a parent chosen by several
children (blocks shared copy-on-write) and drops parents nobody chose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from enc2dec.engine.core.batch import BeamCandidate
from enc2dec.engine.core.request import RequestStatus, Sequence

def normalized_score(cumulative_logprob: float, generated_len: int, length_penalty: float) -> float:
    """transformers' BeamHypotheses score: the log-probability sum over generated_len ** length_penalty."""
    return cumulative_logprob / (generated_len ** length_penalty)


@dataclass
class Hypothesis:
    """A finished beam: the output ids (start token / Whisper prompt excluded) and its scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    status: RequestStatus
    stop_reason: int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class BeamStep:
    """What one step decided: the surviving (parent, candidate) pairs, best first."""

    running: list[tuple[Sequence, BeamCandidate]]
    is_done: bool


@dataclass
class BeamState:
    width: int                   # best_of: beams kept running, hypotheses kept
    num_returned: int            # n: hypotheses returned, best first
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    keep_logprobs: bool = False  # record each token's log-probability (SamplingParams.logprobs set)
    needs_token_ids: bool = False   # logits processors read each beam's output ids
    finished: list[Hypothesis] = field(default_factory=list)   # best first, at most ``width``
    # transformers' is_early_stop_heuristic_unsatisfied: once False, nothing can improve.
    can_improve: bool = True

    def __post_init__(self) -> None:
        assert 1 <= self.num_returned <= self.width, (self.num_returned, self.width)

    @property
    def is_full(self) -> bool:
        return len(self.finished) >= self.width

    def step(self, parents: dict[int, Sequence], candidates: list[BeamCandidate], stop_of, max_output_tokens: int
             ) -> BeamStep:
        """Apply one step's ``candidates`` (sorted best first; parents are the running beams by seq_id).

        ``stop_of(parent, token_id)`` gives ``(status, stop_reason)`` for a candidate, status None
        when it goes on. Finished hypotheses are recorded here; sequences are not touched."""
        running: list[tuple[Sequence, BeamCandidate]] = []
        newly_finished: list[Hypothesis] = []
        all_stop = True
        # Decided before this step's hypotheses are added, as transformers does.
        accepts = self.can_improve and not (self.early_stopping is True and self.is_full)
        for rank, cand in enumerate(candidates):
            parent = parents[cand.parent_seq_id]
            status, stop_reason = stop_of(parent, cand.token_id)
            if status is None:
                all_stop = False
                if len(running) < self.width:
                    running.append((parent, cand))
                continue
            if rank < self.width and accepts:
                gen_len = parent.num_output_tokens + 1
                logprobs = (parent.logprobs or []) + [{cand.token_id: cand.logprob}] if self.keep_logprobs else None
                newly_finished.append(Hypothesis(
                    parent.output_token_ids + [cand.token_id], cand.cumulative_logprob,
                    normalized_score(cand.cumulative_logprob, gen_len, self.length_penalty),
                    status, stop_reason, logprobs))
        if newly_finished:
            merged = self.finished + newly_finished
            # Stable sort: on equal scores the earlier hypothesis stays ahead.
            self.finished = sorted(merged, key=lambda h: -h.score)[:self.width]
        if all_stop or not running:
            return BeamStep([], True)
        gen_len = running[0][0].num_output_tokens + 1      # every running beam has this length now
        self.can_improve = self.can_improve and self._can_improve(running[0][1].cumulative_logprob, gen_len,
                                                                  max_output_tokens)
        is_done = not self.can_improve or (self.early_stopping is True and self.is_full)
        return BeamStep(running, is_done)

    def _can_improve(self, best_running_logprob: float, gen_len: int, max_output_tokens: int) -> bool:
        if not self.is_full:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            gen_len = max_output_tokens     # the best a running beam could still do
        best = normalized_score(best_running_logprob, gen_len, self.length_penalty)
        return best > self.finished[-1].score

    def results(self, running: list[Sequence], status_of_running: RequestStatus) -> list[Hypothesis]:
        """The ``num_returned`` best hypotheses. Running beams (an aborted request) fill in
        after the finished ones, ranked by their normalized score."""
        hyps = list(self.finished)
        if len(hyps) < self.num_returned:
            extra = [Hypothesis(s.output_token_ids, s.cumulative_logprob,
                                normalized_score(s.cumulative_logprob, max(1, s.num_output_tokens),
                                                 self.length_penalty),
                                status_of_running, None, s.logprobs) for s in running]
            hyps += sorted(extra, key=lambda h: -h.score)
        return hyps[:self.num_returned]


def fork_sequence(parent: Sequence, block_ids: list[int]) -> Sequence:
    """A new running beam with ``parent``'s tokens and KV (``block_ids``: the parent's, shared)."""
    return Sequence(token_ids=list(parent.token_ids), num_hidden_tokens=parent.num_hidden_tokens,
                    index=parent.index, block_ids=block_ids, num_computed_tokens=parent.num_computed_tokens,
                    status=parent.status, cumulative_logprob=parent.cumulative_logprob,
                    logprobs=None if parent.logprobs is None else list(parent.logprobs))
