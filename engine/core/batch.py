"""The two objects that cross between policy and mechanism each step.

``SchedulerOutput`` goes from the (pure Python) scheduler to the model runner;
``ModelRunnerOutput`` comes back. Both are plain data: picklable, no torch types
except the opaque ``encoder_input`` and ``sampling_params`` the runner understands.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScheduledEncode:
    """A request admitted this step: encode it and write its cross K/V."""

    request_id: str
    encoder_input: Any            # list[int] token ids, or a Whisper clip (raw wave or [n_mels, frames] features)
    encoder_len: int              # positions written to the cross pool
    cross_block_ids: list[int]    # cross-pool blocks, ceil(encoder_len / tokens_per_block)
    sampling_params: Any = None   # SamplingParams; the runner keeps it until the request ends
    seq_ids: list[int] = field(default_factory=list)
    seq_indices: list[int] = field(default_factory=list)
    # The cross blocks already hold this input's K/V (an encoder cache hit): register the request's
    # sampling state, run no encoder.
    reuses_cross_kv: bool = False


@dataclass(slots=True)
class ScheduledSeq:
    """One decoder sequence to advance by one sampled token this step (built for every running
    sequence every step: slots keep that cheap). ``block_ids`` is the sequence's own list, shared:
    the scheduler replaces a sequence's list rather than changing it, so this one stays as scheduled."""

    seq_id: int
    request_id: str
    input_token_ids: list[int]    # tokens to feed: token_ids[num_computed_tokens:]
    start_pos: int                # decoder position of input_token_ids[0]
    block_ids: list[int]          # self-attention block table (covers start_pos + len(inputs))
    cross_block_ids: list[int]
    encoder_len: int
    num_output_tokens: int        # output tokens before this step (min_tokens, begin-suppress)
    cumulative_logprob: float = 0.0   # the running score; beam search adds it to its candidates
    # The output ids so far, sent only for requests whose Python logits processors read them
    # (Request.needs_host_tokens): such a request is not scheduled while a step of it is in
    # flight, so these are real tokens, never a placeholder. Beams reorder every step, so the
    # runner could not keep their histories itself anyway.
    output_token_ids: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        """Decoder context length after this step's tokens are written."""
        return self.start_pos + len(self.input_token_ids)


@dataclass
class SchedulerOutput:
    encodes: list[ScheduledEncode] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Requests whose runner-side state (generators, params) can be dropped.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Self-pool (src, dst) block copies to run before this step's attention: a beam about to
    # write into a partly filled block it shares with its siblings gets its own copy first.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Nonzero: this step's fresh encodes are deferred joins (SchedulerLimits.defer_joins_while_decoding):
    # none of them decodes in this step, so the runner may encode them beside it.
    encode_ticket: int = 0
    # The last encode ticket whose requests have joined (in this step or before): this step's
    # decode must not start before the encodes up to it have run.
    join_ticket: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.encodes and not self.seqs

    @property
    def num_encoder_tokens(self) -> int:
        return sum(e.encoder_len for e in self.encodes if not e.reuses_cross_kv)

    @property
    def num_decoder_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass(frozen=True)
class BeamCandidate:
    """A continuation of a running beam, proposed by the sampler for beam search."""

    parent_seq_id: int
    token_id: int
    cumulative_logprob: float     # the parent's plus this token's log-probability
    logprob: float                # this token's log-probability


@dataclass
class ModelRunnerOutput:
    # The sampled tokens by row: row i is the step's i-th scheduled sequence. No object per row:
    # at 256 rows such objects set off most of the host path's garbage collections (about one
    # per step).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None                      # of each row's token; None: not asked
    top_logprobs: list[dict[int, float] | None] | None = None
    # Beam-search requests: request_id -> candidates over all its beams, best first.
    beams: dict[str, list[BeamCandidate]] = field(default_factory=dict)
    # seq_id -> {token id: log-probability} at its SamplingParams.prefix_logprob_position
    prefix_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)

