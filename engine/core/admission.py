"""Scheduler limits, and the static question: can this request ever be scheduled?

Pure Python (no torch). ``admission_error`` is asked once per request, before it is
queued, so that a request that could never fit becomes a clear error for the user
instead of a request that waits forever at the head of the FCFS queue.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from enc2dec.engine.core.block_manager import blocks_needed
from enc2dec.engine.core.request import Request, Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int          # running decoder sequences (parallel samples and beams count)
    max_num_tokens: int          # per step: encoder positions + decoder tokens fed
    encoder_max_batch_size: int  # requests encoded in one step
    encoder_max_num_tokens: int  # encoder positions in one step
    tokens_per_block: int
    # Feed decoder prompt tokens one per step, so every step is one token per sequence and can
    # replay a CUDA graph (a Whisper prompt is 4 tokens; BART's start + forced BOS is 2). The
    # samples after the inner prompt tokens are dropped.
    feed_prompt_one_token_per_step: bool = False
    # Encoder positions a step may encode while it also decodes running sequences (0: no bound
    # beyond encoder_max_num_tokens). Every running sequence waits for that step, so this bounds
    # what one admission costs their inter-token latency; the first request of a step is always
    # admitted, so nothing starves.
    encoder_max_num_tokens_while_decoding: int = 0
    # The same bound per sequence the step decodes (0: none; tuning.encoder_tokens_per_decoding_row
    # says why); with both set, the smaller applies.
    encoder_max_num_tokens_per_decoding_row: int = 0
    # k > 0: a request admitted while other sequences decode joins the batch k steps later; the
    # runner encodes it beside those k decode steps (0: it decodes in its admission step).
    defer_joins_while_decoding: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or value == 0 and f.name in (
                    "encoder_max_num_tokens_while_decoding", "encoder_max_num_tokens_per_decoding_row",
                    "defer_joins_while_decoding"):
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


def encoder_admission(tuning, is_whisper: bool, encoder_layers: int, decoder_layers: int,
                      encoder_len: int, beside: bool) -> tuple[int, int]:
    """(encoder positions admitted in a step that also decodes, decoding steps a request
    encoded beside them waits before it joins; 0 when nothing encodes beside) for the
    ``tuning`` values, 0 meaning auto.

    Auto: one clip per decoding step for Whisper, no bound for text models, joining one step
    later. An encoder-heavy Whisper (at most a quarter as many decoder as encoder layers:
    whisper-large-v3-turbo 4 of 32, distil-large-v3 2 of 32) encoded beside the decoder takes two
    clips a step and joins two steps later: its encoder costs several decoding steps, so two clips
    per launch (8% less encoder time a clip) with two steps to run beside gave turbo 8% more out
    tok/s and 17% lower TPOT at C=64 (docs/benchmarks.md, session 27); its ITL p99 rose from 6.7
    to 10.9 ms while p50 fell from 5.9 to 1.2 ms."""
    heavy = is_whisper and beside and 4 * decoder_layers <= encoder_layers
    tokens = tuning.encoder_tokens_while_decoding or (
        # By measurement (docs/benchmarks.md, Run M): one Whisper clip per decoding step takes
        # ITL p99/p50 from 5.2 to 1.1 for 5% of throughput; for BART's cheap 384-token encoder
        # the same rule costs 26%, so text models admit as much as fits.
        (2 if heavy else 1) * encoder_len if is_whisper else 0)
    join = (tuning.encoder_join_steps or (2 if heavy else 1)) if beside else 0
    return tokens, join


def max_kv_tokens(req: Request, seq: Sequence) -> int:
    """Most decoder positions ``seq`` ever holds in the self pool (its last token is never fed)."""
    return seq.num_hidden_tokens + req.max_output_tokens - 1


def admission_error(req: Request, limits: SchedulerLimits, num_self_blocks: int,
                    num_cross_blocks: int) -> str | None:
    """Why ``req`` can never be scheduled; None if it can.

    Checked against an empty engine and the worst case of the request's life: every
    sequence at its last step, recomputed in one step after a preemption. Passing this
    check guarantees the request runs once the requests ahead of it are done.
    """
    tpb = limits.tokens_per_block
    seqs = req.live_seqs
    if not seqs:
        return "the request has no unfinished decoder sequence"
    seqs = seqs + [seqs[0]] * (req.beam_width - len(seqs))   # beams all fork from the first
    num_prefix_outputs = max(s.num_output_tokens for s in seqs)
    if num_prefix_outputs >= req.max_output_tokens:
        return (f"max_tokens={req.max_output_tokens} leaves nothing to generate after "
                f"{num_prefix_outputs} prefix token(s) that count as output (a forced BOS "
                f"counts); raise max_tokens")
    if len(seqs) > limits.max_batch_size:
        return (f"{len(seqs)} decoder sequences (n, or best_of beams) exceed "
                f"max_batch_size={limits.max_batch_size}")
    if req.encoder_len > limits.encoder_max_num_tokens:
        return (f"encoder input of {req.encoder_len} positions exceeds encoder_max_num_tokens="
                f"{limits.encoder_max_num_tokens} (the whole encoder input is encoded in one step)")
    if req.encoder_len > limits.max_num_tokens:
        return (f"encoder input of {req.encoder_len} positions exceeds max_num_tokens="
                f"{limits.max_num_tokens}")
    num_kv_tokens = [max_kv_tokens(req, s) for s in seqs]
    worst_step_tokens = req.encoder_len + sum(num_kv_tokens)
    if worst_step_tokens > limits.max_num_tokens:
        return (f"the request may need {worst_step_tokens} tokens in one step ({req.encoder_len} "
                f"encoder positions + {len(seqs)} sequence(s) of up to {max(num_kv_tokens)} "
                f"decoder positions, recomputed together after a preemption), above "
                f"max_num_tokens={limits.max_num_tokens}; raise max_num_tokens or lower max_tokens")
    num_cross_needed = blocks_needed(req.encoder_len, tpb)
    if num_cross_needed > num_cross_blocks:
        return (f"encoder input of {req.encoder_len} positions needs {num_cross_needed} "
                f"cross-attention KV blocks but the cross pool has {num_cross_blocks}; raise "
                f"cross_kv_cache_fraction or free_gpu_memory_fraction")
    num_self_needed = sum(blocks_needed(n, tpb) for n in num_kv_tokens)
    if num_self_needed > num_self_blocks:
        return (f"{len(seqs)} sequence(s) of up to {max(num_kv_tokens)} decoder positions need "
                f"{num_self_needed} self-attention KV blocks but the self pool has "
                f"{num_self_blocks}; lower max_tokens or n, lower cross_kv_cache_fraction, or "
                f"raise free_gpu_memory_fraction")
    return None
