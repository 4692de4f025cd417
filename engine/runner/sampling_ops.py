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

import torch

from enc2dec.kernels.reference import gumbel_race_ref, race_uniform_ref
from enc2dec.kernels.sampling import gumbel_race     # triton itself loads at the first launch

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


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens each row's filters drop set to -inf, in transformers' order:
    top-k, then top-p over the renormalised survivors, then min-p (relative to the most likely)."""
    # logits: [R, V] (after temperature); top_k: [R] int64 (0 = off); top_p, min_p: [R] float32
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)    # [R, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)                                            # [R, V]
    cum_before = probs.cumsum(dim=-1) - probs        # mass strictly before each token
    # top_p == 1 drops nothing, even where rounding lifts the cumulative sum above 1
    drop = (cum_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]    # the first token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def race(scores: torch.Tensor, seeded_keys: torch.Tensor, num_seeded: int) -> torch.Tensor:
    """One token per row drawn from softmax(``scores``) by a Gumbel-max race.

    ``scores`` [R, V] float32: the temperature-scaled logits with -inf for the tokens the
    filters dropped (no softmax needed: the race is shift-invariant per row; every row keeps
    one finite score). Rows [0, num_seeded) are seeded with ``seeded_keys`` [num_seeded, 3]
    int64 (``stream_key`` words 0 and 1, output position; each in [0, 2**32)); the others
    draw their keys on the device's default generator, so no host sync. The fused
    Triton kernel on CUDA (where triton is installed), the torch reference otherwise. A seeded row's
    token depends only on its own scores and key. Returns [R] int64.
    """
    num_fresh = scores.shape[0] - num_seeded
    fresh = None
    if num_fresh > 0:
        fresh = torch.randint(0, 1 << 32, (num_fresh, 3), device=scores.device)   # [R - num_seeded, 3]
    # On CPU the reference, even where TRITON_INTERPRET=1 is set (the test suite sets it):
    # the interpreter runs a program per row at about 0.1 s each.
    draw = gumbel_race if scores.is_cuda else gumbel_race_ref
    return draw(scores, seeded_keys[:num_seeded], fresh)
