"""The batched math of random sampling: temperature, top-k / top-p / min-p filters, and the
exponential race that draws one token per row, with noise from a counter-based stream for
seeded rows.

Everything here is tensor work on the logits' device; per-row parameters arrive as tensors
(staged once per step by the sampler), so a step never waits for the GPU. A seeded row's
noise is a pure function of (its stream key, its output position, the token id): the same
on every run, on any row of any batch, and after preemption, and it is computed with 64-bit
integer ops that give the same bits on CPU and CUDA.
"""
from __future__ import annotations

import torch

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


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32) in int64 without overflow: multiply 16-bit halves
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # Wellons' lowbias32: a bijection of 32-bit ints in which every input bit flips about
    # half the output bits
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB_352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846C_A68B)
    return x ^ (x >> 16)


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab] float32 from ``keys`` [R, 3] int64 (key word 0, key word 1,
    output position), each in [0, 2**32)."""
    k0, k1, pos = keys.unbind(dim=1)                                      # [R] each
    row0 = _mix32(k0 ^ _mix32((pos + 0x9E37_79B9) & _M32))                # [R]
    row1 = _mix32(k1 ^ _mix32((row0 + 0x632B_E5AB) & _M32))               # [R]
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.long)    # [V]
    # Two rounds over the row words: two rows' noise could only coincide if both words did.
    h = _mix32(_mix32(row0[:, None] ^ tokens[None, :]) ^ row1[:, None])   # [R, V] in [0, 2**32)
    # 23 bits plus a half: exact in float32, so u is never 0 or 1 and -log(u) is finite and > 0
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    return -u.log()


def unseeded_exponential(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] float32 from the device's default generator (no host sync)."""
    noise = torch.empty((rows, vocab), dtype=torch.float32, device=device).exponential_()
    # Some generators can return 0, and 0 / 0 would be NaN, which argmax picks.
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


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


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from ``probs``: argmax(p / E) with E ~ Exp(1) per token wins
    with probability p. Dropped tokens (p = 0) never win: every row keeps one with p > 0."""
    # probs, noise: [R, V] -> [R] int64
    return (probs / noise).argmax(dim=-1)
