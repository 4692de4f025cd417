"""Paged decode attention (decoder self- and cross-attention), split-K / flash-decoding style.

One program per (query token, head, split). A token finds its sequence by a binary search
of ``query_start_loc`` (no host-built maps, so the launch is CUDA-graph safe and any query
length works: one token per sequence in steady decode, the prefix on a first step,
everything again after a preemption). Its keys are ``[0, kv_len)``: for causal
self-attention ``kv_len = q_pos + 1`` with ``q_pos = seq_len - q_len + i``; for cross
attention ``kv_len = enc_len``. With ``num_splits > 1`` the keys are cut into that many
equal chunks per token (chunk sizes follow each sequence's own length, so a graph captured
with one ``num_splits`` stays correct for any lengths), and the last split of each (token,
head) to finish merges the partial softmaxes (or, with ``last_split_merges=False``, a second
kernel does).

Scores are ``scale * q.k + bias[h, q_pos - k_pos]`` in fp32 (exp2 with log2(e) folded
in); inputs fp32/fp16/bf16, or an FP8 pool (e4m3 with a float16 scale per position and
head, ``kv_scales``, any strides): a key's score and a value's weight are multiplied by its scale, so
the math stays fp32 and the read is half of bf16's. Tokens with no keys (padding past
``qsl[S]``, empty sequences) get zeros.
"""
from __future__ import annotations

import functools
import math

import torch

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .kv_store import _store_fp8
from .reference import paged_attention_ref, store_kv_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# Fewest keys a split gets, by default. In a CUDA graph the split count is fixed at capture
# from the longest sequence the graph admits, so small batches of short sequences still pay
# the split and merge; ``tuning.attn_min_keys_per_split`` trades that against long sequences.
MIN_KEYS_PER_SPLIT = 32
_PROGRAMS_PER_SM = 16


@lazy_jit(do_not_specialize=("num_seqs", "num_search_steps"))   # eager steps vary them
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, final_ptr, arrivals_ptr,
    qsl_ptr, kv_lens_ptr, block_tables_ptr, bias_ptr, k_scale_ptr, v_scale_ptr,
    new_k_ptr, new_v_ptr, slot_ptr,
    num_seqs, num_search_steps, scale_log2, bias_len,
    stride_qn, stride_qh, stride_nkn, stride_nkh, stride_nvn, stride_nvh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_on, stride_oh, stride_os, stride_fn, stride_fh,
    stride_bt, stride_bias_h, stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, LAST_MERGES: tl.constexpr, BLOCK_S: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, STORE_NEW: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence of this token: the smallest s with qsl[s + 1] > tok (num_seqs for padding).
    # A decode step feeds one token per sequence, so token tok is usually sequence tok: that
    # guess is checked with loads that do not wait on each other, and only a wrong guess (a
    # prefix, a recompute, padding) pays the binary search's chain of dependent loads before
    # its first K load (short programs ran up to 1.2x faster, docs/kernels.md).
    guess = tl.minimum(tok, num_seqs - 1)
    g_start = tl.load(qsl_ptr + guess)
    g_end = tl.load(qsl_ptr + guess + 1)
    g_kv_len = tl.load(kv_lens_ptr + guess)
    direct = (tok < num_seqs) & (g_start <= tok) & (tok < g_end)
    lo = tl.where(direct, tok, 0)
    hi = tl.where(direct, tok, num_seqs)
    for _ in range(num_search_steps):
        searching = lo < hi
        mid = (lo + hi) // 2
        mid_end = tl.load(qsl_ptr + mid + 1, mask=searching, other=0)
        go_right = searching & (mid_end <= tok)
        go_left = searching & (mid_end > tok)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_left, mid, hi)
    seq = tl.minimum(lo, num_seqs - 1)
    q_start = tl.where(direct, g_start, tl.load(qsl_ptr + seq, mask=~direct, other=0))
    q_end = tl.where(direct, g_end, tl.load(qsl_ptr + seq + 1, mask=~direct, other=0))
    seq_kv_len = tl.where(direct, g_kv_len, tl.load(kv_lens_ptr + seq, mask=~direct, other=0))
    q_pos = seq_kv_len - (q_end - q_start) + (tok - q_start)
    if CAUSAL:
        kv_len = q_pos + 1
    else:
        kv_len = seq_kv_len
    kv_len = tl.where(lo < num_seqs, tl.maximum(kv_len, 0), 0)

    # This split's keys: equal chunks of the token's own length, whole tiles each.
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_begin = split * chunk
    k_end = tl.minimum(k_begin + chunk, kv_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # A head-major pool's head stride is a whole layer's pool: head x stride passes 2**31
    # elements in pools over 4 GiB (whisper-large-v3-turbo's 4 layers share the cross budget).
    head_kv = head.to(tl.int64)
    if STORE_NEW:
        # The token's own K/V (one query per sequence: the caller's promise) is its last key,
        # which only the split holding that key reads: that program writes it to the token's
        # slot before its loop reads the tile (a negative slot, padding, writes nothing).
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        owner = (kv_len - 1) // tl.maximum(chunk, 1)
        s_mask = mask_d & (slot >= 0) & (split == owner)
        s_page = slot // TOKENS_PER_BLOCK
        s_in = slot % TOKENS_PER_BLOCK
        nk = tl.load(new_k_ptr + tok * stride_nkn + head * stride_nkh + offs_d, mask=s_mask, other=0.0)
        nv = tl.load(new_v_ptr + tok * stride_nvn + head * stride_nvh + offs_d, mask=s_mask, other=0.0)
        dst_k = k_ptr + s_page * stride_kb + s_in * stride_kt + head_kv * stride_kh + offs_d
        dst_v = v_ptr + s_page * stride_vb + s_in * stride_vt + head_kv * stride_vh + offs_d
        if FP8:
            new_s_off = s_page * stride_sb + s_in * stride_st + head_kv * stride_sh
            one = tl.arange(0, 1)
            s_mask1 = (slot >= 0) & (split == owner) & (one == 0)
            _store_fp8(nk.to(tl.float32)[None, :], dst_k[None, :], k_scale_ptr + new_s_off + one,
                       s_mask[None, :], s_mask1)
            _store_fp8(nv.to(tl.float32)[None, :], dst_v[None, :], v_scale_ptr + new_s_off + one,
                       s_mask[None, :], s_mask1)
        else:
            tl.store(dst_k, nk.to(k_ptr.dtype.element_ty), mask=s_mask)
            tl.store(dst_v, nv.to(v_ptr.dtype.element_ty), mask=s_mask)
        tl.debug_barrier()
    q = tl.load(q_ptr + tok * stride_qn + head * stride_qh + offs_d, mask=mask_d, other=0.0)
    q = q.to(tl.float32) * scale_log2                                        # [BLOCK_D]

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Each tile's page ids are loaded one tile ahead, so a tile's K/V loads wait on no load
    # issued in the same iteration.
    offs_n = k_begin + tl.arange(0, BLOCK_N)
    next_page = tl.load(table_row + offs_n // TOKENS_PER_BLOCK, mask=offs_n < k_end, other=0)
    for n0 in range(k_begin, k_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)                                  # [BLOCK_N]
        mask_n = offs_n < k_end
        page = next_page.to(tl.int64)
        ahead = offs_n + BLOCK_N
        next_page = tl.load(table_row + ahead // TOKENS_PER_BLOCK, mask=ahead < k_end, other=0)
        in_page = (offs_n % TOKENS_PER_BLOCK).to(tl.int64)
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k_off = page * stride_kb + in_page * stride_kt + head_kv * stride_kh    # [BLOCK_N]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)                    # [BLOCK_N]
        if FP8:
            s_off = page * stride_sb + in_page * stride_st + head_kv * stride_sh
            s *= tl.load(k_scale_ptr + s_off, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_BIAS:
            rel = tl.minimum(tl.maximum(q_pos - offs_n, 0), bias_len - 1)
            b = tl.load(bias_ptr + head * stride_bias_h + rel, mask=mask_n, other=0.0)
            s += b.to(tl.float32) * 1.4426950408889634
        s = tl.where(mask_n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))   # finite: a tile's first key is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)                                               # [BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v_off = page * stride_vb + in_page * stride_vt + head_kv * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        if FP8:
            pv = p * tl.load(v_scale_ptr + s_off, mask=mask_n, other=0.0).to(tl.float32)
        else:
            pv = p
        acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)   # [BLOCK_D]
        m_i = m_new

    out_row = out_ptr + tok * stride_on + head * stride_oh
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_row + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)
    else:
        # Un-normalised partials; m_ptr/l_ptr are [N, H, NUM_SPLITS] contiguous.
        tl.store(out_row + split * stride_os + offs_d, acc, mask=mask_d)
        token_head = tok * tl.num_programs(1) + head
        stat = token_head * NUM_SPLITS + split
        tl.store(m_ptr + stat, m_i)
        tl.store(l_ptr + stat, l_i)
        if LAST_MERGES:
            # The last split of a (token, head) to finish merges them all, so a step launches
            # no merge kernel. The release half of the count orders this program's partial
            # stores before it; the acquire half lets the last one read every other's. The
            # last one also puts the count back to zero, ready for the next launch.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + token_head, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                _merge_partials(out_ptr + tok * stride_on + head * stride_oh, stride_os,
                                m_ptr + token_head * NUM_SPLITS, l_ptr + token_head * NUM_SPLITS,
                                final_ptr + tok * stride_fn + head * stride_fh,
                                HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, True)
                tl.store(arrivals_ptr + token_head, 0)


@lazy_jit.helper
def _merge_partials(part_row, stride_ps, m_row, l_row, out_row,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr, FROM_L2: tl.constexpr):
    # One (token, head)'s output from its splits' un-normalised partials; FROM_L2 reads past the
    # SM's L1, whose lines may predate another program's stores.
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    cache: tl.constexpr = ".cg" if FROM_L2 else ""
    m = tl.load(m_row + offs_s, mask=mask_s, other=float("-inf"), cache_modifier=cache)   # [BLOCK_S]
    l = tl.load(l_row + offs_s, mask=mask_s, other=0.0, cache_modifier=cache)
    has_keys = m > float("-inf")
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.where(has_keys, tl.exp2(tl.where(has_keys, m, m_max) - m_max), 0.0)   # [BLOCK_S]
    part = tl.load(part_row + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0, cache_modifier=cache)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)   # [BLOCK_D]
    tl.store(out_row + offs_d, out.to(out_row.dtype.element_ty), mask=mask_d)


@lazy_jit
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr,
    stride_pn, stride_ph, stride_ps, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    token_head = tok * tl.num_programs(1) + head
    _merge_partials(part_ptr + tok * stride_pn + head * stride_ph, stride_ps,
                    m_ptr + token_head * NUM_SPLITS, l_ptr + token_head * NUM_SPLITS,
                    out_ptr + tok * stride_on + head * stride_oh,
                    HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, False)


class SplitArrivals:
    """The arrival counts of the split programs of each (token, head), per device: zero between
    launches (each launch's last arrivals put theirs back). Grown outside CUDA-graph capture only,
    and never freed, since a captured graph keeps the address it was captured with. Launches
    that share one must not run at the same time (on two streams): each engine's attention
    backend holds its own."""

    MIN_PAIRS = 1 << 15

    def __init__(self):
        self.held: dict[torch.device, list[torch.Tensor]] = {}

    def counts(self, device: torch.device, needed: int) -> torch.Tensor | None:
        """Zeroed int32 counts for ``needed`` pairs, or None when none is big enough and one
        cannot be made now (inside a graph capture: the caller merges with its own kernel)."""
        held = self.held.setdefault(device, [])
        if held and held[-1].numel() >= needed:
            return held[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        held.append(torch.zeros(max(needed, self.MIN_PAIRS, 2 * held[-1].numel() if held else 0),
                                dtype=torch.int32, device=device))
        return held[-1]


_SHARED_ARRIVALS = SplitArrivals()      # for calls that bring none (tests, scripts)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_config(block_d: int, element_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the attention kernel for a padded head_dim.

    Small one-warp programs (a 1024-element K tile) keep the most loads in flight: on an
    H200 (bf16, 2026-11-30) they read Whisper cross K/V at c=64 at 4.1 TB/s against 1.7 TB/s
    for 4-warp 64x64 tiles; num_stages made no difference (the loop has no tl.dot). An FP8
    tile keeps bf16's bytes, so twice the keys.
    """
    elements = 2048 if element_bytes == 1 else 1024
    return max(8, min(256, elements // block_d)), 1, 2


def pick_num_splits(num_tokens: int, num_heads: int, max_kv_len: int, device: torch.device,
                    min_keys_per_split: int = MIN_KEYS_PER_SPLIT) -> int:
    """Split-K until there are about ``_PROGRAMS_PER_SM`` programs per SM (or the keys run out).

    Host-side: ``max_kv_len`` comes from the metadata's host lists; each split gets at least
    ``min_keys_per_split`` keys. A power of two, so few
    kernel variants get compiled. Measured best on an H200: T5-large self c=64 (1024
    token-heads, 256 keys) 4 splits; Whisper cross c=64 (1280, 1500 keys) 2; c=8 16.
    """
    want = math.ceil(_PROGRAMS_PER_SM * _num_sms(device) / max(1, num_tokens * num_heads))
    by_len = math.ceil(max_kv_len / min_keys_per_split)
    return _next_pow2(max(1, min(want, by_len, _MAX_SPLITS)))


def paged_attention(q, k_cache, v_cache, query_start_loc, kv_lens, block_tables, scale: float, *,
                    causal: bool, bias_table: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, num_splits: int | None = None,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    last_split_merges: bool = True, arrivals: SplitArrivals | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of packed queries over paged K/V; returns ``out`` ``[N, H, D]`` (q's dtype).

    q: [N, H, D]; k_cache, v_cache: [num_blocks, tokens_per_block, H, D];
    query_start_loc: [S + 1] int32; kv_lens: [S] int32 (self: seq_lens incl. new tokens,
    cross: enc_lens); block_tables: [S, max_blocks] int32; bias_table: [H, L] read at
    ``clamp(q_pos - k_pos, 0, L - 1)`` (the T5 decoder table; meant for causal use).
    ``num_splits`` None picks by occupancy from the block-table width (callers with
    host-side lengths pass ``pick_num_splits(...)``); results do not depend on it.
    ``kv_scales``: (k_scale, v_scale) [num_blocks, tokens_per_block, H] float16 of an FP8 pool.
    ``last_split_merges``: with splits, the last split of each (token, head) to finish merges
    them (one launch) instead of a second kernel, counting arrivals in ``arrivals`` (None: a
    module-wide one; calls that share one must not run at the same time on two streams).
    ``new_kv``: (k, v [N, H, D], slot_mapping [N]) of a causal call with one query per sequence:
    the kernel stores them first (``store_kv``'s result), one launch instead of two.
    """
    if new_kv is not None:
        assert causal and q.shape[0] == kv_lens.shape[0], "new_kv needs one query per sequence"
    if not can_use_triton(q, k_cache, v_cache, block_tables):
        if new_kv is not None:
            store_kv_ref(*new_kv[:2], k_cache, v_cache, new_kv[2], kv_scales)
        return paged_attention_ref(q, k_cache, v_cache, query_start_loc, kv_lens, block_tables, scale,
                                   causal=causal, bias_table=bias_table, out=out, kv_scales=kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    tokens_per_block = k_cache.shape[1]
    assert k_cache.shape[2:] == (num_heads, head_dim), "cache [heads, head_dim] must match q (no GQA)"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert tokens_per_block & (tokens_per_block - 1) == 0, "tokens_per_block must be a power of two"
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * tokens_per_block
        num_splits = pick_num_splits(num_tokens, num_heads, max_kv_len, q.device)
    block_d = _next_pow2(head_dim)
    block_n, num_warps, num_stages = launch_config(block_d, k_cache.element_size())
    fp8 = kv_scales is not None
    k_scale, v_scale = kv_scales if fp8 else (q, q)                          # q: dummy pointers
    if fp8:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    counts = None
    if num_splits > 1:
        part = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)                                 # [N, H, splits, D]
        m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        dst, stride_os = part, part.stride(2)
        if last_split_merges:
            counts = (arrivals or _SHARED_ARRIVALS).counts(q.device, num_tokens * num_heads)
    else:
        part = m = l = None
        dst, stride_os = out, 0
    has_bias = bias_table is not None
    bias = bias_table.contiguous() if has_bias else q                       # q: a dummy pointer
    search_steps = max(1, num_seqs).bit_length() + 1
    new_k, new_v, slots = new_kv if new_kv is not None else (q, q, query_start_loc)   # dummy pointers
    if new_kv is not None:
        assert new_k.shape == new_v.shape == q.shape and new_k.stride(2) == 1 and new_v.stride(2) == 1
    _paged_attention_kernel[(num_tokens, num_heads, num_splits)](
        q, k_cache, v_cache, dst, m if m is not None else dst, l if l is not None else dst,
        out, counts if counts is not None else query_start_loc,
        query_start_loc, kv_lens, block_tables, bias, k_scale, v_scale, new_k, new_v, slots,
        num_seqs, search_steps, scale * _LOG2E, bias_table.shape[1] if has_bias else 1,
        q.stride(0), q.stride(1), new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        dst.stride(0), dst.stride(1), stride_os, out.stride(0), out.stride(1),
        block_tables.stride(0), bias.stride(0) if has_bias else 0,
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, k_scale.stride(2) if fp8 else 0,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, TOKENS_PER_BLOCK=tokens_per_block,
        NUM_SPLITS=num_splits, LAST_MERGES=counts is not None, BLOCK_S=_next_pow2(num_splits), CAUSAL=causal, HAS_BIAS=has_bias, FP8=fp8, STORE_NEW=new_kv is not None, num_warps=num_warps,
        num_stages=num_stages, **launch_options(q),
    )
    if num_splits > 1 and counts is None:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part, m, l, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=_next_pow2(num_splits), num_warps=1,
        )
    return out
