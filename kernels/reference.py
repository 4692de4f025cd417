"""Pure-torch references for every kernel in this package, with the kernels' signatures.

They define what the kernels compute (the tests compare the two on random inputs) and
are the fallback wherever Triton cannot run. They favour clarity over memory; the
attention and norm references are also free of host syncs (``store_kv_ref`` is not: it
selects the non-negative slots with a boolean mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def token_seq_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence of each of ``num_tokens`` packed tokens; ``S`` for tokens past ``qsl[S]``."""
    qsl = query_start_loc.long()                                            # [S + 1]
    tokens = torch.arange(num_tokens, device=qsl.device)                    # [N]
    return torch.searchsorted(qsl[1:].contiguous(), tokens, right=True)     # [N]


# FP8 KV cache (kv_cache_config.dtype="fp8"): e4m3 values with one float16 scale per stored
# position and head (its amax / 448), so every row uses the whole e4m3 range whatever the
# layer's activations; dequantised as value * scale. Scale tensors: [num_blocks, tokens_per_block, heads].
FP8_MAX = 448.0
FP8_SCALE_DTYPE = torch.float16
FP8_MIN_SCALE = 2.0 ** -14      # float16's smallest normal: all-zero rows still divide safely


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (e4m3 values [..., D], float16 scales [...]) with x ~ values * scales."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE).to(FP8_SCALE_DTYPE)
    q = (xf / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_ref(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as float32: ``cache * scale`` for an FP8 pool, else just the upcast."""
    return cache.float() if scale is None else cache.float() * scale.float()[..., None]


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, kv_lens, block_tables, scale: float, *,
                        causal: bool, bias_table: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, num_splits: int | None = None,
                        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of packed queries over paged K/V (see ``paged_attention.paged_attention``).

    ``num_splits`` only steers the kernel's split-K and is ignored here. ``kv_scales``:
    (k_scale, v_scale) [num_blocks, tokens_per_block, H] of an FP8 pool.
    """
    num_tokens = q.shape[0]                                                 # q: [N, H, D]
    num_seqs = kv_lens.shape[0]
    tokens_per_block = k_cache.shape[1]                                     # cache: [B, T, H, D]
    qsl = query_start_loc.long()
    seq = token_seq_index(qsl, num_tokens)                                  # [N]
    is_real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    q_start, q_end = qsl[seq], qsl[seq + 1]                                 # [N]
    kv_len = kv_lens.long()[seq]                                            # [N]
    q_pos = kv_len - (q_end - q_start) + (torch.arange(num_tokens, device=q.device) - q_start)
    limit = torch.where(is_real, q_pos + 1 if causal else kv_len, 0)        # keys each token sees
    k_pos = torch.arange(block_tables.shape[1] * tokens_per_block, device=q.device)  # [K]
    pages = block_tables.long()[seq][:, k_pos // tokens_per_block]          # [N, K]
    in_page = k_pos % tokens_per_block
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    k = dequantize_ref(k_cache[pages, in_page], None if k_scale is None else k_scale[pages, in_page])   # [N, K, H, D]
    v = dequantize_ref(v_cache[pages, in_page], None if v_scale is None else v_scale[pages, in_page])
    scores = torch.einsum("nhd,nkhd->nhk", q.float(), k) * scale            # [N, H, K]
    if bias_table is not None:
        rel = (q_pos[:, None] - k_pos[None, :]).clamp(0, bias_table.shape[1] - 1)   # [N, K]
        scores = scores + bias_table.float()[:, rel].transpose(0, 1)        # [N, H, K]
    visible = k_pos[None, :] < limit[:, None]                               # [N, K]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                   # tokens with no keys -> 0
    result = torch.einsum("nhk,nkhd->nhd", probs, v)                        # [N, H, D]
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``k, v [N, H, D]`` into cache slots; a negative slot (padding) is skipped. With
    ``kv_scales`` (an FP8 pool's scale tensors) each row is stored quantised."""
    keep = slot_mapping >= 0                                                # [N]
    slots = slot_mapping[keep].long()
    for x, cache, sc in zip((k, v), (k_cache, v_cache), kv_scales or (None, None)):
        x = x[keep]
        if sc is not None:
            x, row_scale = quantize_fp8_ref(x)                              # [n, H, D], [n, H]
            sc.view(-1, sc.shape[-1]).index_copy_(0, slots, row_scale)
        _rows(cache).index_copy_(0, slots, _raw(x.to(cache.dtype)))


def _raw(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no float8 kernels: copy FP8 rows as their bytes
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """A pool [num_blocks, tokens_per_block, H, D] as slot rows [slots, H, D], writable in place."""
    return _raw(cache).view(-1, *cache.shape[2:])


def _residual_sum(x, residual):
    # Rounded to the residual stream's dtype first, like the eager model's ``x + residual``.
    return x if residual is None else (x.float() + residual.float()).to(residual.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float):
    """T5 RMSNorm of ``x + residual`` (no mean, no bias, fp32 math) -> (normed, new_residual)."""
    h = _residual_sum(x, residual)                                          # [..., hidden]
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), h


def fused_add_layer_norm_ref(x, residual, weight, bias, eps: float):
    """LayerNorm of ``x + residual`` (fp32 math) -> (normed, new_residual)."""
    h = _residual_sum(x, residual)
    b = None if bias is None else bias.float()
    normed = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), b, eps)
    return normed.to(x.dtype), h


def gelu_ref(x, approximate: str = "none"):
    """GELU, exact (``"none"``, erf) or ``"tanh"`` (HF ``gelu_new``), computed in fp32."""
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def gated_gelu_ref(x, approximate: str = "tanh"):
    """``x [..., 2F]`` = gate | up halves -> ``gelu(gate) * up [..., F]`` (T5 v1.1 gated-gelu)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)


def skinny_linear_ref(x, weight, bias=None):
    """``x @ weight.T + bias`` (the library GEMM)."""
    return F.linear(x, weight, bias)


# The counter-based noise of the sampling race (``sampling.gumbel_race``). Its bits are the
# definition: the kernel computes them in native uint32, this reference in int64 words kept
# in [0, 2**32), and both must agree for every key and token id.
_M32 = 0xFFFF_FFFF


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


def race_uniform_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise u [R, vocab] float32 in (0, 1) from ``keys`` [R, 3] int64 (key word 0,
    key word 1, output position, each in [0, 2**32)): a pure function of (key, token id)."""
    k0, k1, pos = keys.long().unbind(dim=1)                               # [R] each
    row0 = _mix32(k0 ^ _mix32((pos + 0x9E37_79B9) & _M32))                # [R]
    row1 = _mix32(k1 ^ _mix32((row0 + 0x632B_E5AB) & _M32))               # [R]
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.long)    # [V]
    # Two rounds over the row words: two rows' noise could only coincide if both words did.
    h = _mix32(_mix32(row0[:, None] ^ tokens[None, :]) ^ row1[:, None])   # [R, V] in [0, 2**32)
    # 23 bits plus a half: exact in float32, so u is never 0 or 1 and both logs are finite
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0 ** -23


def gumbel_race_ref(scores: torch.Tensor, seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None = None,
                    block: int | None = None) -> torch.Tensor:
    """One token per row: argmax(scores - log(-log u)) with ``u = race_uniform_ref(keys)``,
    keys = ``seeded_keys`` [S, 3] for rows [0, S), then ``fresh_keys`` for the rest.

    -log(-log u) is Gumbel noise, so for ``scores`` = logits (any per-row offset) the winner
    is distributed as softmax(scores); -inf scores never win unless the whole row is -inf
    (then token 0). ``block`` only steers the kernel and is ignored here."""
    # scores: [R, V] float -> [R] int64
    keys = seeded_keys if fresh_keys is None else torch.cat([seeded_keys.long(), fresh_keys.long()])   # [R, 3]
    u = race_uniform_ref(keys, scores.shape[-1])                          # [R, V]
    return (scores.float() - (-u.log()).log()).argmax(dim=-1)


def top_k_floor_ref(scores: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Each row's top-k floor: its ``top_k``-th largest score (ties counted, so every token
    tied with it stays, as transformers' ``TopKLogitsWarper`` keeps them); -inf where
    ``top_k`` is 0 (off). ``max_k`` >= every row's k, at most the vocabulary (the host knows
    it, so no sync). scores: [R, V] float; top_k: [R] int64 -> [R] float32."""
    if max_k <= 0:
        return torch.full(scores.shape[:1], float("-inf"), device=scores.device)
    vals = scores.float().topk(max_k, dim=-1).values                        # [R, max_k], descending
    kth = vals.gather(1, (top_k.clamp(min=1, max=max_k) - 1)[:, None])[:, 0]
    return torch.where(top_k > 0, kth, torch.full_like(kth, float("-inf")))


def filter_scores_ref(scores: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """``scores`` with the tokens the filters drop set to -inf, in transformers' order.

    K: the tokens at or above the row's top-k ``floor``. Top-p over K's renormalised
    softmax: in descending score order (ties by token id) a token stays while the mass
    strictly before it is below ``top_p`` (so the most likely always stays; ``top_p`` = 1
    drops nothing). Min-p: a token stays if its probability is at least ``min_p`` times the
    most likely one's. The three sets are upper sets of one order, which is what lets the
    fused kernel (``sampling.filtered_race``) find the race's winner without sorting.
    scores: [R, V] float32; floor, top_p, min_p: [R] float32 -> [R, V] float32."""
    s = scores.float()
    top = s.max(dim=-1, keepdim=True).values                                # [R, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))      # all -inf rows stay as they are
    in_k = s >= floor[:, None]
    e = torch.where(in_k, (s - top).exp(), torch.zeros_like(s))             # [R, V] unnormalised mass
    keep = in_k & (e >= min_p[:, None])
    z = e.sum(dim=-1, keepdim=True)                                         # [R, 1]
    order = s.masked_fill(~in_k, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    sorted_e = e.gather(1, order)
    before = torch.cat([torch.zeros_like(sorted_e[:, :1]), sorted_e.cumsum(dim=-1)[:, :-1]], dim=1)
    in_p = torch.empty_like(keep).scatter_(1, order, before < top_p[:, None] * z)
    keep &= in_p | (top_p >= 1.0)[:, None]
    return s.masked_fill(~keep, float("-inf"))


def filtered_race_ref(scores: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      seeded_keys: torch.Tensor, fresh_keys: torch.Tensor | None = None,
                      block: int | None = None, splits: int | None = None) -> torch.Tensor:
    """The race over each row's filtered scores: ``gumbel_race_ref(filter_scores_ref(...))``.
    ``block`` and ``splits`` only steer the kernel and are ignored here."""
    return gumbel_race_ref(filter_scores_ref(scores, floor, top_p, min_p), seeded_keys, fresh_keys)
