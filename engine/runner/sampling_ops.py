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

import torch

from enc2dec.kernels.reference import (filtered_race_ref, gumbel_race_ref, race_uniform_ref,
                                       top_k_floor_ref)
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
    return -race_uniform_ref(keys, vocab).log()


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
    # On CPU the references, even where TRITON_INTERPRET=1 is set (the test suite sets it):
    # the interpreter runs a program per row at about 0.1 s each.
    seeded = seeded_keys[:num_seeded]
    if filters is None:
        return (gumbel_race if scores.is_cuda else gumbel_race_ref)(scores, seeded, fresh)
    top_k, top_p, min_p, max_k = filters
    if max_k <= 0:                    # no row cuts by top-k: a constant floor, made once per size
        floor = _no_floor(scores.shape[0], scores.device)
    else:
        floor = top_k_floor_ref(scores, top_k, min(max_k, scores.shape[-1]))      # [R]; -inf = off
    return (filtered_race if scores.is_cuda else filtered_race_ref)(scores, floor, top_p, min_p, seeded, fresh)
