"""The sampling race fused into one pass: per row, Gumbel-max over the vocabulary with
counter-based noise, returning only the winning token (no [R, V] noise tensor); and the
same race over the tokens that top-k / top-p / min-p keep, found without a sort.

One program per row loops over the vocabulary in blocks. For each token it hashes (row
key, token id) with native uint32 arithmetic into the same bits as
``reference.race_uniform_ref``, turns them into Gumbel noise ``-log(-log u)``, adds the
score and keeps a running per-lane maximum; one reduction at the end picks the row's
winner, the lowest token id on a tie (as ``torch.argmax``). The integer bits are exact on
every device; the two logs may differ from torch's by an ulp, so kernel and reference can
disagree only where two tokens' race values tie within float rounding.

A small batch leaves most SMs idle with one program per row, so ``filtered_race`` then cuts
each row into chunks, one program each, and merges per-chunk partials between passes
(``race_splits`` picks the count; see the split kernels below).
"""
from __future__ import annotations

import functools
import math
import threading

import torch

from . import can_use_triton, lazy_jit
from .reference import filtered_race_ref, gumbel_race_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

BLOCK = 512           # tokens per loop step: 26 us for 64 rows at vocab 32128 on the H200
NUM_WARPS = 4         # (2048 and 8 warps: 30 us; 1024 and 4 warps: 46 us)


@lazy_jit.helper
def _mix32(x):
    # reference._mix32 (lowbias32) on uint32: multiplication wraps mod 2**32 natively
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB_352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846C_A68B, tl.uint32)
    return x ^ (x >> 16)


@lazy_jit.helper
def _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh):
    # the row's two hash words from its key (reference.race_uniform_ref's row0, row1)
    if row < num_seeded:
        key = seeded_ptr + row * stride_seeded
    else:
        key = fresh_ptr + (row - num_seeded) * stride_fresh
    k0 = tl.load(key).to(tl.uint32)
    k1 = tl.load(key + 1).to(tl.uint32)
    pos = tl.load(key + 2).to(tl.uint32)
    row0 = _mix32(k0 ^ _mix32(pos + tl.full((), 0x9E37_79B9, tl.uint32)))
    row1 = _mix32(k1 ^ _mix32(row0 + tl.full((), 0x632B_E5AB, tl.uint32)))
    return row0, row1


@lazy_jit.helper
def _race_values(s, tokens, row0, row1):
    # score + Gumbel noise of each token: reference.gumbel_race_ref's race value
    h = _mix32(_mix32(row0 ^ tokens.to(tl.uint32)) ^ row1)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07   # 2**-23
    return s - tl.log(-tl.log(u))


@lazy_jit(do_not_specialize=("num_seeded",))    # 0..rows, any step: one compiled variant
def _gumbel_race_kernel(scores_ptr, seeded_ptr, fresh_ptr, out_ptr, vocab, num_seeded,
                        stride_s, stride_seeded, stride_fresh, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row0, row1 = _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)       # per lane: best value so far
    best_id = lanes                                            # and its token (first on ties)
    for start in range(0, vocab, BLOCK):
        tokens = start + lanes
        in_vocab = tokens < vocab
        s = tl.load(scores_ptr + row * stride_s + tokens, mask=in_vocab, other=float("-inf")).to(tl.float32)
        value = _race_values(s, tokens, row0, row1)
        better = value > best          # strict: an earlier token keeps a tie
        best = tl.where(better, value, best)
        best_id = tl.where(better, tokens, best_id)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


@lazy_jit.helper
def _masked_race(base, lo, hi, vocab, row0, row1, shift, floor, pivot_score, pivot, BEFORE: tl.constexpr,
                 BLOCK: tl.constexpr):
    # One pass over tokens [lo, hi) of the row: the mass (exp(score - shift)) of the tokens
    # kept, their race winner (lowest id on a tie; ``lo`` when none is kept) and its race
    # value. Kept: BEFORE=False those at or above the top-k ``floor``; BEFORE=True those
    # ranked before ``pivot`` (score descending, token id ascending on ties).
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = lo + lanes
    for start in range(lo, hi, BLOCK):
        tokens = start + lanes
        s = tl.load(base + tokens, mask=tokens < hi, other=float("-inf")).to(tl.float32)
        if BEFORE:
            keep = (s > pivot_score) | ((s == pivot_score) & (tokens < pivot))
        else:
            keep = s >= floor
        mass += tl.where(keep, tl.exp(s - shift), 0.0)
        value = tl.where(keep, _race_values(s, tokens, row0, row1), float("-inf"))
        better = value > best          # strict: an earlier token keeps a tie
        best = tl.where(better, value, best)
        best_id = tl.where(better, tokens, best_id)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    return tl.sum(mass, axis=0), winner, top


@lazy_jit(do_not_specialize=("num_seeded",))
def _filtered_race_kernel(scores_ptr, floor_ptr, top_p_ptr, min_p_ptr, seeded_ptr, fresh_ptr, out_ptr,
                          vocab, num_seeded, stride_s, stride_seeded, stride_fresh, BLOCK: tl.constexpr):
    # The winner of the race over the row's filtered tokens (reference.filter_scores_ref),
    # found without sorting. Top-k, top-p and min-p each keep an upper set of one order
    # (score descending, token id ascending on ties), so: race over the top-k set; if the
    # winner w fails min-p or top-p (mass before it >= top_p of the set's mass), nothing at
    # or after w in that order survives either, so race again over the tokens before w
    # (one pass computes both the mass before w and that next winner). With the same noise
    # the race over a subset picks the subset's own argmax, so the accepted winner is
    # exactly the reference's. Rounds: about one when the first winner is typical.
    row = tl.program_id(0).to(tl.int64)
    row0, row1 = _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh)
    base = scores_ptr + row * stride_s
    floor = tl.load(floor_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        tokens = start + lanes
        s = tl.load(base + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, s)
    top = tl.max(lane_max, axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)      # an all -inf row keeps its scores
    # The top-k set's mass (unnormalised, relative to the most likely) and its race winner.
    total, winner, _ = _masked_race(base, 0, vocab, vocab, row0, row1, shift, floor, 0.0, 0, False, BLOCK)
    win_score = tl.load(base + winner).to(tl.float32)
    done = (top == float("-inf")) | ((tl.exp(win_score - shift) >= min_p) & (top_p >= 1.0))
    winner, win_score = _rejection_rounds(base, vocab, row0, row1, shift, total, top_p, min_p, winner, win_score,
                                          done, BLOCK)
    tl.store(out_ptr + row, winner.to(tl.int64))


@lazy_jit.helper
def _rejection_rounds(base, vocab, row0, row1, shift, total, top_p, min_p, winner, win_score, done,
                      BLOCK: tl.constexpr):
    # Whole-row rejection rounds from an undecided winner until one is kept.
    while not done:
        before, next_winner, _ = _masked_race(base, 0, vocab, vocab, row0, row1, shift, 0.0, win_score, winner,
                                              True, BLOCK)
        kept = (tl.exp(win_score - shift) >= min_p) & ((top_p >= 1.0) | (before < top_p * total))
        done = kept
        if not kept:
            winner, win_score = next_winner, tl.load(base + next_winner).to(tl.float32)
    return winner, win_score


# The split race: each row's vocabulary cut into SPLITS chunks of whole blocks, one program
# per (row, chunk), so a small batch still fills the GPU. Every pass writes per-chunk
# partials (max; kept mass, race winner and its race value) and the next launch merges its
# row's partials itself (SPLITS values), so no pass needs a merge kernel of its own. The
# merge keeps the single program's answer: the race value of every token is computed alike,
# and the lowest token id among the chunks' best values is the lowest among the row's. Only
# the masses are summed in another order (a float rounding apart). A round's state (winner,
# its score, the top-k mass, done) goes to its own buffer slot, written by
# chunk 0, so no launch reads what it writes. SPLIT_ROUNDS rejection rounds run split; a
# row still undecided after them finishes in the per-row kernel (rare: each round rejects
# only a winner in the tail of the filtered mass).
SPLIT_ROUNDS = 2
SPLIT_TARGET_WAVES = 4      # programs per SM to aim for: 4-warp programs need several to hide the hash math
# A long row is split further, to chunks of about SPLIT_CHUNK_BLOCKS blocks, while the programs stay
# within SPLIT_MAX_WAVES per SM: at 256 x 51,866 on the H200 2 splits took 221 us, 8 took 137 and
# 16 took 133 (bench/scripts/race_bench.py, docs/benchmarks.md Run M).
SPLIT_CHUNK_BLOCKS = 8
SPLIT_MAX_WAVES = 16
MIN_SPLIT_BLOCKS = 4        # a chunk shorter than this many blocks costs more in merging than it saves


@lazy_jit.helper
def _chunk_bounds(chunk, vocab):
    lo = tl.program_id(1) * chunk
    return lo, tl.minimum(lo + chunk, vocab)


@lazy_jit(do_not_specialize=("chunk",))
def _split_max_kernel(scores_ptr, max_ptr, vocab, chunk, stride_s, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    lo, hi = _chunk_bounds(chunk, vocab)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        tokens = start + lanes
        s = tl.load(base + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, s)
    tl.store(max_ptr + row * SPLITS + tl.program_id(1), tl.max(lane_max, axis=0))


@lazy_jit.helper
def _row_shift(max_ptr, row, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    k = tl.arange(0, SPLITS_P2)
    top = tl.max(tl.load(max_ptr + row * SPLITS + k, mask=k < SPLITS, other=float("-inf")), axis=0)
    return top, tl.where(top > float("-inf"), top, 0.0)      # an all -inf row keeps its scores


@lazy_jit.helper
def _merge_partials(part_f, part_i, row, vocab, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    # a pass's per-chunk (mass, race value) and winner -> the row's mass and winner
    k = tl.arange(0, SPLITS_P2)
    in_row = k < SPLITS
    slot = row * SPLITS + k
    mass = tl.sum(tl.load(part_f + 2 * slot, mask=in_row, other=0.0), axis=0)
    value = tl.load(part_f + 2 * slot + 1, mask=in_row, other=float("-inf"))
    ids = tl.load(part_i + slot, mask=in_row, other=vocab)
    best = tl.max(value, axis=0)
    return mass, tl.min(tl.where(value == best, ids, vocab), axis=0)


@lazy_jit.helper
def _split_state(base, row, vocab, top_p, min_p, max_ptr, prev_f, prev_i, state_in_f, state_in_i,
                 AFTER_FLOOR: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    # The row's state after the previous pass: (winner, its score, top-k mass, shift, done).
    # AFTER_FLOOR: that pass raced the top-k set; else it was a rejection round from
    # state_in, whose partials exist only where state_in was undecided.
    top, shift = _row_shift(max_ptr, row, SPLITS, SPLITS_P2)
    mass, next_winner = _merge_partials(prev_f, prev_i, row, vocab, SPLITS, SPLITS_P2)
    if AFTER_FLOOR:
        total = mass
        winner = next_winner
        win_score = tl.load(base + winner).to(tl.float32)
        done = (top == float("-inf")) | ((tl.exp(win_score - shift) >= min_p) & (top_p >= 1.0))
    else:
        winner = tl.load(state_in_i + row * 2)
        was_done = tl.load(state_in_i + row * 2 + 1) != 0
        win_score = tl.load(state_in_f + row * 2)
        total = tl.load(state_in_f + row * 2 + 1)
        kept = (tl.exp(win_score - shift) >= min_p) & ((top_p >= 1.0) | (mass < top_p * total))
        reject = ~(was_done | kept)
        winner = tl.where(reject, next_winner, winner)
        win_score = tl.load(base + winner).to(tl.float32)
        done = was_done | kept
    return winner, win_score, total, shift, done


@lazy_jit(do_not_specialize=("num_seeded", "chunk"))
def _split_floor_kernel(scores_ptr, floor_ptr, max_ptr, seeded_ptr, fresh_ptr, part_f, part_i, vocab, chunk,
                        num_seeded, stride_s, stride_seeded, stride_fresh, SPLITS: tl.constexpr,
                        SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr):
    # each chunk's share of the top-k set: its mass and race winner
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    row0, row1 = _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh)
    _, shift = _row_shift(max_ptr, row, SPLITS, SPLITS_P2)
    lo, hi = _chunk_bounds(chunk, vocab)
    mass, winner, value = _masked_race(base, lo, hi, vocab, row0, row1, shift, tl.load(floor_ptr + row), 0.0, 0,
                                       False, BLOCK)
    slot = row * SPLITS + tl.program_id(1)
    tl.store(part_f + 2 * slot, mass)
    tl.store(part_f + 2 * slot + 1, value)
    tl.store(part_i + slot, winner)


@lazy_jit(do_not_specialize=("num_seeded", "chunk"))
def _split_round_kernel(scores_ptr, top_p_ptr, min_p_ptr, max_ptr, seeded_ptr, fresh_ptr, prev_f, prev_i,
                        state_in_f, state_in_i, state_f, state_i, part_f, part_i, vocab, chunk, num_seeded,
                        stride_s, stride_seeded, stride_fresh, AFTER_FLOOR: tl.constexpr, SPLITS: tl.constexpr,
                        SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr):
    # one rejection round: each chunk's mass before the undecided winner and its next winner
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    winner, win_score, total, shift, done = _split_state(
        base, row, vocab, tl.load(top_p_ptr + row), tl.load(min_p_ptr + row), max_ptr, prev_f, prev_i,
        state_in_f, state_in_i, AFTER_FLOOR, SPLITS, SPLITS_P2)
    if tl.program_id(1) == 0:
        tl.store(state_i + row * 2, winner)
        tl.store(state_i + row * 2 + 1, done.to(tl.int32))
        tl.store(state_f + row * 2, win_score)
        tl.store(state_f + row * 2 + 1, total)
    if not done:
        row0, row1 = _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh)
        lo, hi = _chunk_bounds(chunk, vocab)
        mass, next_winner, value = _masked_race(base, lo, hi, vocab, row0, row1, shift, 0.0, win_score, winner,
                                                True, BLOCK)
        slot = row * SPLITS + tl.program_id(1)
        tl.store(part_f + 2 * slot, mass)
        tl.store(part_f + 2 * slot + 1, value)
        tl.store(part_i + slot, next_winner)


@lazy_jit(do_not_specialize=("num_seeded",))
def _split_finish_kernel(scores_ptr, top_p_ptr, min_p_ptr, max_ptr, seeded_ptr, fresh_ptr, prev_f, prev_i,
                         state_in_f, state_in_i, out_ptr, vocab, num_seeded, stride_s, stride_seeded, stride_fresh,
                         AFTER_FLOOR: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                         BLOCK: tl.constexpr):
    # the last split pass's verdict; a row still undecided goes on round by round alone
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    winner, win_score, total, shift, done = _split_state(base, row, vocab, top_p, min_p, max_ptr, prev_f, prev_i,
                                                         state_in_f, state_in_i, AFTER_FLOOR, SPLITS, SPLITS_P2)
    row0, row1 = _row_words(seeded_ptr, fresh_ptr, row, num_seeded, stride_seeded, stride_fresh)
    winner, win_score = _rejection_rounds(base, vocab, row0, row1, shift, total, top_p, min_p, winner, win_score,
                                          done, BLOCK)
    tl.store(out_ptr + row, winner.to(tl.int64))


def _int64_rows(keys: torch.Tensor) -> torch.Tensor:
    # Contiguous rows from a 16-byte boundary: Triton specialises a pointer on that alignment,
    # so a slice like keys[1:] would compile another variant of the kernel at its first launch.
    keys = keys.long()
    if keys.stride(-1) == 1 and keys.data_ptr() % 16 == 0:
        return keys
    return keys.clone(memory_format=torch.contiguous_format)


def gumbel_race(scores: torch.Tensor, seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None = None,
                block: int = BLOCK) -> torch.Tensor:
    """One token per row, ``argmax(scores - log(-log u))`` with u hashed from the row's key.

    scores: [R, V] float (finite or -inf; logits in any per-row offset: the winner follows
    their softmax); rows [0, S) take their keys from ``seeded_keys`` [S, 3] and rows [S, R)
    from ``fresh_keys`` [R - S, 3] (two tensors, so the caller needs no concatenation);
    each key is int64 (word 0, word 1, output position), each in [0, 2**32). -> [R] int64.
    ``block`` only steers the kernel (tests use small ones).
    """
    if not can_use_triton(scores, seeded_keys, *(() if fresh_keys is None else (fresh_keys,))):
        return gumbel_race_ref(scores, seeded_keys, fresh_keys)
    rows, vocab = scores.shape
    num_seeded = seeded_keys.shape[0]
    num_fresh = 0 if fresh_keys is None else fresh_keys.shape[0]
    assert num_seeded + num_fresh == rows and seeded_keys.shape[1:] == (3,), \
        f"keys for {num_seeded} + {num_fresh} rows, scores have {rows}"
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    if rows == 0:
        return out
    scores, seeded, fresh = _launch_args(scores, seeded_keys, fresh_keys)
    _gumbel_race_kernel[(rows,)](scores, seeded, fresh, out, vocab, num_seeded,
                                 scores.stride(0), seeded.stride(0), fresh.stride(0),
                                 BLOCK=block, num_warps=NUM_WARPS)
    return out


def _launch_args(scores, seeded_keys, fresh_keys):
    # contiguous rows, int64 keys; a missing key tensor is replaced by the other (never read)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    seeded = _int64_rows(seeded_keys) if seeded_keys.shape[0] else None
    fresh = _int64_rows(fresh_keys) if fresh_keys is not None and fresh_keys.shape[0] else None
    return scores, (seeded if seeded is not None else fresh), (fresh if fresh is not None else seeded)


def filtered_race(scores: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None = None,
                  block: int = BLOCK, splits: int | None = None) -> torch.Tensor:
    """``gumbel_race`` over each row's tokens that survive its top-k ``floor`` (from
    ``reference.top_k_floor_ref``), ``top_p`` and ``min_p`` ([R] float32 each): the same
    token as ``reference.filtered_race_ref``, with no sort, softmax or [R, V] temporary.
    Keys as for ``gumbel_race``. -> [R] int64. ``block`` and ``splits`` (programs per row;
    ``None``: ``race_splits``' choice) only steer the kernels."""
    tensors = (scores, floor, top_p, min_p, seeded_keys, *(() if fresh_keys is None else (fresh_keys,)))
    if not can_use_triton(*tensors):
        return filtered_race_ref(scores, floor, top_p, min_p, seeded_keys, fresh_keys)
    rows, vocab = scores.shape
    num_seeded = seeded_keys.shape[0]
    num_fresh = 0 if fresh_keys is None else fresh_keys.shape[0]
    assert num_seeded + num_fresh == rows == floor.shape[0] == top_p.shape[0] == min_p.shape[0], \
        f"keys for {num_seeded} + {num_fresh} rows and {floor.shape[0]} filters, scores have {rows}"
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    if rows == 0:
        return out
    scores, seeded, fresh = _launch_args(scores, seeded_keys, fresh_keys)
    floor, top_p, min_p = (t.float().contiguous() for t in (floor, top_p, min_p))
    if splits is None:
        splits = race_splits(rows, vocab, block, scores.device)
    if splits <= 1:
        _filtered_race_kernel[(rows,)](scores, floor, top_p, min_p, seeded, fresh, out, vocab, num_seeded,
                                       scores.stride(0), seeded.stride(0), fresh.stride(0),
                                       BLOCK=block, num_warps=NUM_WARPS)
        return out
    _split_filtered_race(scores, floor, top_p, min_p, seeded, fresh, out, num_seeded, block, splits)
    return out


def race_splits(rows: int, vocab: int, block: int = BLOCK, device: torch.device | None = None) -> int:
    """Programs per row for ``filtered_race``: enough for ``SPLIT_TARGET_WAVES`` programs per SM,
    or chunks of about ``SPLIT_CHUNK_BLOCKS`` blocks while that stays within ``SPLIT_MAX_WAVES``
    (a power of two, so few kernel variants), none shorter than ``MIN_SPLIT_BLOCKS`` blocks;
    1 (the per-row kernel) once the rows alone fill the GPU."""
    sms, rows, blocks = _sm_count(device), max(rows, 1), -(-vocab // block)
    want = max(SPLIT_TARGET_WAVES * sms // rows, min(blocks // SPLIT_CHUNK_BLOCKS, SPLIT_MAX_WAVES * sms // rows))
    most = blocks // MIN_SPLIT_BLOCKS
    splits = min(want, most)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device | None) -> int:
    if device is None or device.type != "cuda":
        return 132          # the H200's, for the interpreter and for planning on a host without a GPU
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


_SCRATCH = threading.local()
SCRATCH_SHAPES = 32          # per thread; past it the cache starts over


def _split_scratch(rows: int, splits: int, rounds: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The split race's partial results, made once per shape and per thread: every launch
    writes before it reads, and one thread's launches run in stream order, so its steps can
    share them (five allocations fewer per sampled step, host time when the step loop is
    host-bound). Per thread, because two engines in one process step on threads of their own
    and their launches may interleave on one stream."""
    cache = getattr(_SCRATCH, "buffers", None)
    if cache is None:
        cache = _SCRATCH.buffers = {}
    key = (rows, splits, rounds, dev)
    buffers = cache.get(key)
    if buffers is None:
        if len(cache) >= SCRATCH_SHAPES:
            cache.clear()
        buffers = cache[key] = (
            torch.empty(rows, splits, dtype=torch.float32, device=dev),
            _per_round(rounds, (rows, splits, 2), torch.float32, dev),   # (mass, race value)
            _per_round(rounds, (rows, splits), torch.int32, dev),        # chunk winner
            _per_round(rounds, (rows, 2), torch.float32, dev),           # (winner's score, top-k mass)
            _per_round(rounds, (rows, 2), torch.int32, dev))             # (winner, done)
    return buffers


def _per_round(rounds: int, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """[rounds + 1, *shape], each [r] contiguous and starting on a 16-byte boundary (its slab
    padded): Triton specialises a pointer argument on that alignment, so with unpadded slabs
    a batch of a new size (63 rows puts [1] at 504 bytes) compiled another variant of the round
    kernels at its first sampled step, a 0.3-0.4 s stall of every running request (H100,
    docs/benchmarks.md session 29)."""
    size = math.prod(shape)
    per = -(-size * dtype.itemsize // 16) * 16 // dtype.itemsize
    return torch.empty(rounds + 1, per, dtype=dtype, device=dev)[:, :size].view(rounds + 1, *shape)


def _split_filtered_race(scores, floor, top_p, min_p, seeded, fresh, out, num_seeded, block, splits):
    # Launches (rows x splits programs each): chunk maxima; the top-k race; SPLIT_ROUNDS
    # rejection rounds; then one program per row for the verdict. A fixed sequence for given
    # shapes: rows decided early skip their passes on the device, so no host sync.
    rows, vocab = scores.shape
    chunk = -(-(-(-vocab // block)) // splits) * block          # whole blocks per chunk
    rounds = SPLIT_ROUNDS
    part_max, part_f, part_i, state_f, state_i = _split_scratch(rows, splits, rounds, scores.device)
    strides = (scores.stride(0), seeded.stride(0), fresh.stride(0))
    meta = dict(SPLITS=splits, SPLITS_P2=1 << (splits - 1).bit_length(), BLOCK=block, num_warps=NUM_WARPS)
    grid = (rows, splits)
    _split_max_kernel[grid](scores, part_max, vocab, chunk, scores.stride(0), SPLITS=splits, BLOCK=block,
                            num_warps=NUM_WARPS)
    _split_floor_kernel[grid](scores, floor, part_max, seeded, fresh, part_f[0], part_i[0], vocab, chunk,
                              num_seeded, *strides, **meta)
    for r in range(1, rounds + 1):
        _split_round_kernel[grid](scores, top_p, min_p, part_max, seeded, fresh, part_f[r - 1], part_i[r - 1],
                                  state_f[r - 1], state_i[r - 1], state_f[r], state_i[r], part_f[r], part_i[r],
                                  vocab, chunk, num_seeded, *strides, AFTER_FLOOR=r == 1, **meta)
    _split_finish_kernel[(rows,)](scores, top_p, min_p, part_max, seeded, fresh, part_f[rounds], part_i[rounds],
                                  state_f[rounds], state_i[rounds], out, vocab, num_seeded, *strides,
                                  AFTER_FLOOR=rounds == 0, **meta)
