"""The batched math of random sampling: temperature, top-k / top-p / min-p filters, and the
race that draws one token per row from counter-based noise.

Everything here is tensor work on the logits' device; per-row parameters arrive as tensors
(staged once per step by the sampler), so a step never waits for the GPU. A row's noise is
a pure function of (its key, the token id), hashed with integer ops that give the same
bits on CPU and CUDA (``kernels.reference.race_uniform_ref`` defines them; on CUDA the
fused ``kernels.sampling.gumbel_race`` computes them in registers). A seeded row's key is
its stream key and output position: the same on every run, on any row of any batch, and
after preemption. An unseeded row's key is drawn on the device each step.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from enc2dec.kernels.reference import race_uniform_ref, top_k_floor_ref
from enc2dec.kernels.sampling import filtered_race, gumbel_race     # triton itself loads at the first launch

_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E37_79B9_7F4A_7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return x ^ (x >> 31)


def stream_key(seed: int, index: int) -> tuple[int, int]:
    """Two 32-bit words naming the stream of sequence ``index`` of a request with ``seed``
    (on the host, once per sequence): the ``n`` samples of one request differ."""
    z = _splitmix64((seed & _M64) ^ _splitmix64(index))
    return z & _M32, z >> 32


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab] float32 from ``keys`` [R, 3] int64 (key word 0, key word 1,
    output position), each in [0, 2**32): -log of the race's uniform noise."""
    return -(race_uniform_cpu(keys, vocab) if keys.device.type == "cpu" else race_uniform_ref(keys, vocab)).log()


@functools.lru_cache(maxsize=16)
def _no_floor(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((rows,), float("-inf"), device=device)     # read only, by every step of this size


def race(scores: torch.Tensor, seeded_keys: torch.Tensor, num_seeded: int,
         filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """One token per row drawn from softmax(``scores``) by a Gumbel-max race, over the tokens
    each row's filters keep.

    ``scores`` [R, V] float32: the temperature-scaled logits, -inf for tokens already
    banned (no softmax needed: the race is shift-invariant per row). Rows [0, num_seeded)
    are seeded with ``seeded_keys`` [num_seeded, 3] int64 (``stream_key`` words 0 and 1,
    output position; each in [0, 2**32)); the others draw their keys on the device's
    default generator, so no host sync. ``filters``: (top_k [R] int64 with 0 = off, top_p
    [R], min_p [R] float32, the largest top_k, known on the host) in transformers' order
    (``kernels.reference.filter_scores_ref``); None filters nothing. The fused Triton
    kernels on CUDA (where triton is installed), the torch reference otherwise. A seeded
    row's token depends only on its own scores, filters and key. Returns [R] int64.
    """
    num_fresh = scores.shape[0] - num_seeded
    fresh = None
    if num_fresh > 0:
        fresh = torch.randint(0, 1 << 32, (num_fresh, 3), device=scores.device)   # [R - num_seeded, 3]
    # On CPU the torch versions below, even where TRITON_INTERPRET=1 is set (the test suite sets
    # it): the interpreter runs a program per row at about 0.1 s each.
    seeded = seeded_keys[:num_seeded]
    if filters is None:
        return (gumbel_race if scores.is_cuda else gumbel_race_cpu)(scores, seeded, fresh)
    top_k, top_p, min_p, max_k = filters
    if max_k <= 0:                    # no row cuts by top-k: a constant floor, made once per size
        floor = _no_floor(scores.shape[0], scores.device)
    else:
        floor = top_k_floor_ref(scores, top_k, min(max_k, scores.shape[-1]))      # [R]; -inf = off
    return (filtered_race if scores.is_cuda else filtered_race_cpu)(scores, floor, top_p, min_p, seeded, fresh)


# ---- the race on the CPU ------------------------------------------------------------------
# The references (kernels/reference.py) define the race; on the CPU they were most of a
# sampled step's sampling: flan-t5-small at 4 rows, 2 cores, the uniform noise 3.9 ms (each
# 32-bit product emulated in int64 halves) and top-p's stable sort of the vocabulary 5.1 ms.
# These give the same tokens with numpy's uint32 arithmetic, which wraps mod 2**32 by
# definition (0.5 ms), and the fused kernel's search without a sort.
_K1, _K2 = np.uint32(0x7FEB_352D), np.uint32(0x846C_A68B)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    # reference._mix32 in place on uint32
    x ^= x >> 16
    x *= _K1
    x ^= x >> 15
    x *= _K2
    x ^= x >> 16
    return x


@functools.lru_cache(maxsize=8)
def _token_ids_u32(vocab: int) -> np.ndarray:
    return np.arange(vocab, dtype=np.uint32)           # read only


def race_uniform_cpu(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``race_uniform_ref(keys, vocab)``, the same bits, for keys on the CPU."""
    k = keys.cpu().numpy().astype(np.uint32)                                 # [R, 3]; keys are < 2**32
    row0 = _mix32_np(k[:, 0] ^ _mix32_np(k[:, 2] + np.uint32(0x9E37_79B9)))   # [R]
    row1 = _mix32_np(k[:, 1] ^ _mix32_np(row0 + np.uint32(0x632B_E5AB)))     # [R]
    h = _mix32_np(row0[:, None] ^ _token_ids_u32(vocab)[None, :])             # [R, V]
    h ^= row1[:, None]
    h = _mix32_np(h)
    h >>= 9
    u = h.astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(2.0 ** -23)
    return torch.from_numpy(u)


def _race_values(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    # score + Gumbel noise, as the reference computes it: s - log(-log u)  [R, V] float32
    return scores.float() - race_uniform_cpu(keys, scores.shape[-1]).log_().neg_().log_()


def _keys(seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None) -> torch.Tensor:
    return seeded_keys if fresh_keys is None else torch.cat([seeded_keys.long(), fresh_keys.long()])


def gumbel_race_cpu(scores: torch.Tensor, seeded_keys: torch.Tensor,
                    fresh_keys: torch.Tensor | None = None) -> torch.Tensor:
    """``gumbel_race_ref``'s tokens, on the CPU. -> [R] int64"""
    return _race_values(scores, _keys(seeded_keys, fresh_keys)).argmax(dim=-1)


def filtered_race_cpu(scores: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None = None) -> torch.Tensor:
    """``filtered_race_ref``'s tokens, on the CPU, found as the fused kernel finds them: race
    over the top-k set; while a row's winner fails min-p or top-p (the mass before it in score
    order, ties by token id, at least ``top_p`` of the set's), race again over the tokens before
    it (every token after it fails too). The top-p mass is a sum in another order than the
    reference's cumulative sum, so the two can differ only where a token's mass before it
    equals ``top_p`` of the total to float rounding. -> [R] int64"""
    s = scores.float()                                                        # [R, V]
    vocab = s.shape[-1]
    value = _race_values(s, _keys(seeded_keys, fresh_keys))                   # [R, V]
    top = s.max(dim=-1, keepdim=True).values                                  # [R, 1]
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))      # an all -inf row keeps its scores
    in_k = s >= floor.float()[:, None]
    mass = torch.where(in_k, (s - shift).exp(), torch.zeros_like(s))          # [R, V] unnormalised
    cut = top_p.float()[:, None] * mass.sum(dim=-1, keepdim=True)             # [R, 1]
    wants_p = top_p < 1.0
    value = value.masked_fill_(~in_k, float("-inf"))
    ids = torch.arange(vocab)
    winner = value.argmax(dim=-1, keepdim=True)                               # [R, 1]
    done = (top == float("-inf"))[:, 0]
    while True:
        win_score = s.gather(1, winner)                                       # [R, 1]
        before = (s > win_score) | ((s == win_score) & (ids < winner))        # [R, V] the tokens before it
        kept = (win_score - shift).exp()[:, 0] >= min_p
        if bool(wants_p.any()):
            kept &= ~wants_p | (torch.where(before, mass, 0.0).sum(dim=-1) < cut[:, 0])
        done |= kept
        if bool(done.all()):
            return winner[:, 0]
        value = torch.where(done[:, None], value, value.masked_fill(~before, float("-inf")))
        challenger = value.argmax(dim=-1, keepdim=True)
        # a row with no token left (top-p 0): the reference's race over nothing, token 0
        empty = (value.gather(1, challenger) == float("-inf"))[:, 0] & ~done
        winner = torch.where(done[:, None], winner, torch.where(empty[:, None], 0, challenger))
        done |= empty
