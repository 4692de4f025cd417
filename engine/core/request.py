"""Request and sequence state shared by the scheduler and the engine loop.

Pure Python: nothing here imports torch. A request owns one encoder input (text tokens
or audio features, opaque here) and one or more decoder sequences (``n`` parallel
samples, or the running beams of a beam search). All sequences of a request share its
cross-attention blocks.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # not encoded (new, or preempted: its KV was dropped)
    RUNNING = "running"          # cross-KV written, decoding
    FINISHED_STOPPED = "stop"    # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"   # max_tokens or the decoder position table
    FINISHED_ABORTED = "abort"   # cancelled by the caller, or failed

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


LIVE_STATUSES = (RequestStatus.WAITING, RequestStatus.RUNNING)   # a plain tuple: the hot loops test it
_seq_counter = itertools.count()

# With the overlap scheduler a sequence's newest token is appended before the GPU has
# sampled it; this id stands in for it until Scheduler.resolve() writes the real one.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class Sequence:
    """One decoder sequence.

    ``token_ids`` is every decoder token, the prefix included: ``[decoder_start]``,
    ``[decoder_start, forced_bos]`` or a Whisper prompt, then the sampled tokens.
    The first ``num_hidden_tokens`` are not returned to the user (the start token, or
    the whole Whisper prompt); so a forced BOS is returned and counts as output.
    ``num_computed_tokens`` decoder tokens have their K/V in the self-attention pool;
    a step computes ``token_ids[num_computed_tokens:]`` and samples one token after.
    ``block_ids`` is replaced, never mutated in place, so a ``ScheduledSeq`` may share it.
    """

    token_ids: list[int]
    num_hidden_tokens: int
    index: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_hidden_tokens:]

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens without the trailing placeholder (a token the GPU is still sampling). Placeholders
        only ever trail, and the engine looks between steps, when at most one is pending."""
        ids = self.token_ids
        return len(ids) - (ids[-1] == PLACEHOLDER_TOKEN_ID)

    @property
    def num_resolved_output_tokens(self) -> int:
        return self.num_resolved_tokens - self.num_hidden_tokens

    @property
    def resolved_output_token_ids(self) -> list[int]:
        """Output ids without a trailing placeholder (a copy: O(length), for final outputs)."""
        return self.token_ids[self.num_hidden_tokens:self.num_resolved_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_hidden_tokens

    @property
    def num_new_tokens(self) -> int:
        """Decoder tokens the next step must feed (1 while decoding; more on first or resumed steps)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in LIVE_STATUSES


@dataclass(slots=True)
class Request:
    """A user request as the scheduler sees it.

    ``encoder_len`` is the number of encoder positions whose cross K/V must be stored
    (prompt tokens, or Whisper's 1500 frames). ``encoder_input`` is opaque to the
    scheduler (token ids or a feature tensor) and is handed to the model runner.
    ``max_output_tokens`` already includes the forced BOS and the Whisper position cap.
    """

    request_id: str
    encoder_len: int
    encoder_input: Any
    seqs: list[Sequence]
    max_output_tokens: int
    sampling_params: Any = None
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    cross_block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # A step needs the previous step's tokens on the host (SamplingParams.needs_host_tokens):
    # the scheduler sends the output ids with each of its sequences, and so never schedules the
    # request while a step of it is in flight (launched, not yet resolved): it pauses alone.
    needs_host_tokens: bool = False
    has_step_in_flight: bool = False
    # Nonzero: admitted with a deferred join (SchedulerOutput.encode_ticket), not yet joined; the
    # request keeps its rows but is not scheduled.
    encode_pending: int = 0
    # Beam search (a beam_search.BeamState): ``seqs`` are then the running beams, best first,
    # starting from one; finished hypotheses live in the state, not in ``seqs``.
    beam: Any = None
    # SamplingParams.prefix_logprob_token_ids: {token id: log-probability}, from the step that read
    # the prefix (a recompute after preemption reads it again, to the same values).
    prefix_logprobs: dict[int, float] | None = None
    # Names the encoder input (the prompt's multi_modal_uuids): a finished request's cross blocks
    # are kept under it, and a later request with the same key decodes from them unencoded
    # (encoder_cache.py). None: never cached.
    encoder_cache_key: str | None = None

    @property
    def beam_width(self) -> int:
        """Sequences the request may run at once once its beams expand (1 without beam search)."""
        return self.beam.width if self.beam is not None else 1

    @property
    def is_finished(self) -> bool:
        return all(s.status not in LIVE_STATUSES for s in self.seqs)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status in LIVE_STATUSES]
