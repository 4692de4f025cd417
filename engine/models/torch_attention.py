"""The torch attention backend: the CPU path and the reference the Triton kernels are tested
against (the four functions are described in ``attention.py``).

On the CPU a decoder step is bound by the number of small ops and OpenMP regions, not by
flops (flan-t5-small at batch 1: ~50 attention calls per step on [6, 1, <64] tensors). So
everything that is the same for every layer of one step or one encoder forward (gather
indices, the causal / padding mask with the T5 bias folded in, the valid store slots) is
built at the first layer and reused by the others, keyed by the identity of the step's
metadata; and a decode step (one new token per sequence) runs one batched 4-D
``scaled_dot_product_attention`` per layer, which also picks PyTorch's fused CPU kernel
(3-D inputs fall to the unfused math path). Prefixes and recompute after preemption (query
lengths above one) take the per-sequence loop. FP8 pools (``kv_scales``) run the kernels'
torch references: correct everywhere, fast only on the GPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from enc2dec.kernels.reference import paged_attention_ref, store_kv_ref

# Cross-attention over encoder K/V longer than this reads each request's blocks as a view of
# the pool when they are consecutive, instead of gathering a copy every step and layer (a
# Whisper clip's 1500 positions are 3 MB per layer and pool for whisper-base).
VIEW_MIN_KEYS = 256
# Shorter ones (a text encoder's) are read in place too when every row has the same length and
# the rows fall into at most this many evenly spaced groups: a CPU decode step at a few rows is
# bound by its op count, and a gather is two ops per layer and pool.
SHORT_VIEW_MAX_GROUPS = 2


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when it already is: a decode step would otherwise pay
    a dispatch for each of its ~40 no-op conversions (pools and queries share the model's dtype)."""
    return t if t.dtype == dtype else t.to(dtype)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence: [length, num_heads, head_dim]."""
    tpb = cache.shape[1]
    n = (length + tpb - 1) // tpb
    return cache.index_select(0, block_table[:n].long()).flatten(0, 1)[:length]


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, dtype) -> torch.Tensor:
    """Blocks ``pages [S, nb]`` of a pool as [S, H, nb * tokens_per_block, D]. ``index_select``
    rather than ``cache[pages]``: advanced indexing opens an OpenMP region even for one block,
    which on a loaded two-core machine costs milliseconds (measured: 2.1 ms against 12 us)."""
    num_seqs, num_blocks = pages.shape
    rows = cache.index_select(0, pages.reshape(-1))                     # [S * nb, T, H, D]
    return _as(rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2), dtype)


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _arithmetic_run(tables: list[list[int]]) -> tuple[int, int] | None:
    """(first block, gap) when row i's pages are blocks ``first + i * gap + j`` (j = 0, 1, ...):
    every row on consecutive blocks, the rows' first blocks in order and evenly spaced. Then
    the pages are one strided view of the pool instead of a gathered copy (a request's blocks are
    handed out in order, and requests admitted together get theirs one after another)."""
    first = tables[0][0]
    gap = tables[1][0] - first if len(tables) > 1 else 0
    if gap < 0:
        return None
    for i, row in enumerate(tables):
        base = first + i * gap
        if any(b != base + j for j, b in enumerate(row)):
            return None
    return first, gap


def _strided_pages(cache: torch.Tensor, num_seqs: int, run: tuple[int, int], length: int, dtype) -> torch.Tensor:
    """``length`` positions of each row from the blocks of ``run`` (``_arithmetic_run``), as the
    view [S, H, length, D] of the pool that ``_gather_pages`` would copy out. Either pool layout
    (``KVCache.allocate``): a block's positions follow the previous block's in both."""
    first, gap = run
    block, pos, head, dim = cache.stride()
    return _as(cache.as_strided((num_seqs, cache.shape[2], length, cache.shape[3]), (gap * block, head, pos, dim),
                                cache.storage_offset() + first * block), dtype)


def _consecutive_starts(tables: list[list[int]], lens: list[int], tpb: int) -> list[int] | None:
    """Each row's first block when the blocks holding its ``lens`` positions are consecutive."""
    starts = []
    for row, n in zip(tables, lens):
        used = row[:(n + tpb - 1) // tpb]
        if any(b != used[0] + i for i, b in enumerate(used)):
            return None
        starts.append(used[0])
    return starts


def _spaced_groups(starts: list[int]) -> list[tuple[list[int], int, int]]:
    """Rows split into groups whose first blocks, in increasing order, step by one gap:
    (rows, first block, gap) each, greedily along the sorted starts. Beams of one request share
    their cross blocks (gap 0); clips admitted one after another get back-to-back runs."""
    groups: list[tuple[list[int], int, int]] = []
    rows: list[int] = []
    gap = 0
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        if len(rows) >= 2 and starts[i] - starts[rows[-1]] != gap:
            groups.append((rows, starts[rows[0]], gap))
            rows = []
        if len(rows) == 1:
            gap = starts[i] - starts[rows[0]]
        rows.append(i)
    groups.append((rows, starts[rows[0]], gap))
    return groups


def _shared_runs(starts: list[int]) -> tuple[int, int, int, int] | None:
    """(runs, rows per run, first block, gap) when the rows come in runs of m > 1 consecutive rows
    on the same blocks (a beam-search request's beams) and the runs' blocks step by one gap."""
    m = 1
    while m < len(starts) and starts[m] == starts[0]:
        m += 1
    if m == 1 or len(starts) % m:
        return None
    firsts = starts[::m]
    if any(starts[i] != firsts[i // m] for i in range(len(starts))):
        return None
    gap = firsts[1] - firsts[0] if len(firsts) > 1 else 0
    if any(b - a != gap for a, b in zip(firsts, firsts[1:])) or (len(firsts) > 1 and gap <= 0):
        return None
    return len(firsts), m, firsts[0], gap


class TorchAttentionBackend:
    """Gathers blocks and runs ``scaled_dot_product_attention``; runs anywhere."""

    name = "torch"
    # KVCache.allocate's head-major pools: decode attention streams each head's keys in one run.
    head_major_pools = True

    def __init__(self):
        self._enc = None     # (meta, bias_table, dtype, mask): one encoder forward's bias
        self._dec = None     # (meta, {key: value}): one decoder step's indices and masks
        self._slots = None   # (slot_mapping, its _version, boolean keep mask or None if all kept)

    # ---- encoder ----------------------------------------------------------------------------
    def encoder_attention(self, q, k, v, meta, scale: float,
                          bias_table: torch.Tensor | None = None) -> torch.Tensor:
        # q, k, v: [num_tokens, num_heads, head_dim] packed by meta.cu_seqlens
        num_tokens, num_heads, head_dim = q.shape
        batch, length = meta.batch_size, meta.max_seqlen
        if meta.padded_lens is None and num_tokens == batch * length:     # equal lengths: one call
            bias = self._encoder_bias(meta, bias_table, q.dtype, q.device)                  # [1, H, L, L]
            qb, kb, vb = (t.view(batch, length, num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, scale=scale)     # [B, H, L, D]
            return o.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
        out = torch.zeros_like(q)
        starts = meta.cu_seqlens.tolist()
        keys = meta.seq_lens if meta.padded_lens is None else meta.padded_lens.tolist()
        for i, (n, nk) in enumerate(zip(meta.seq_lens, keys)):
            s = starts[i]
            qi = q[s:s + n].transpose(0, 1)[None]                             # [1, H, n, D]
            ki, vi = (t[s:s + nk].transpose(0, 1)[None] for t in (k, v))     # [1, H, nk, D]
            bias = None
            if bias_table is not None:
                half = (bias_table.shape[1] + 1) // 2
                rel = (torch.arange(nk, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]
                       + half - 1)                                            # [n, nk] k_pos - q_pos
                bias = bias_table[:, rel].to(q.dtype)[None]                  # [1, H, n, nk]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=bias, scale=scale)
            out[s:s + n] = o[0].transpose(0, 1)
        return out

    def _encoder_bias(self, meta, bias_table, dtype, device) -> torch.Tensor | None:
        if bias_table is None:
            return None
        cached = self._enc
        if cached is not None and cached[0] is meta and cached[1] is bias_table and cached[2] == dtype:
            return cached[3]
        half = (bias_table.shape[1] + 1) // 2
        pos = torch.arange(meta.max_seqlen, device=device)
        rel = pos[None, :] - pos[:, None] + half - 1                          # [L, L] k_pos - q_pos
        bias = bias_table[:, rel].to(dtype)[None]                            # [1, H, L, L]
        self._enc = (meta, bias_table, dtype, bias)
        return bias

    # ---- cache writes -----------------------------------------------------------------------
    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        # k, v: [N, H, D]; slot_mapping: [N], a negative slot (padding) is skipped
        if kv_scales is not None:               # FP8 pools: the reference quantises (no CPU fast path)
            return store_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        keep = self._kept(slot_mapping)
        if keep is not None:
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        slots = _as(slot_mapping, torch.int64)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, _as(k, k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, _as(v, v_cache.dtype))

    def _kept(self, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Which slots to write, or None for all; every layer of a step passes the same tensor."""
        c = self._slots
        if c is None or c[0] is not slot_mapping or c[1] != slot_mapping._version:
            keep = slot_mapping >= 0
            c = self._slots = (slot_mapping, slot_mapping._version, None if bool(keep.all()) else keep)
        return c[2]

    # ---- decoder ----------------------------------------------------------------------------
    def _step_cache(self, meta) -> dict:
        if self._dec is None or self._dec[0] is not meta:
            self._dec = (meta, {"is_decode": all(n == 1 for n in meta.query_lens_host)})
        return self._dec[1]

    def self_attention(self, q, k_cache, v_cache, meta, scale: float,
                       bias_table: torch.Tensor | None = None, kv_scales=None, new_kv=None) -> torch.Tensor:
        # q: [N, H, D]; the new tokens' K/V are already stored, or given as new_kv = (k, v) to store first.
        if new_kv is not None:
            self.store_kv(*new_kv, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if kv_scales is not None:
            return paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, causal=True, bias_table=bias_table, kv_scales=kv_scales)
        step = self._step_cache(meta)
        if not step["is_decode"]:
            return self._self_attention_loop(q, k_cache, v_cache, meta, scale, bias_table)
        tpb = k_cache.shape[1]
        if "self_pages" not in step:
            nb = (max(meta.seq_lens_host) + tpb - 1) // tpb
            step["self_pages"] = meta.block_tables[:, :nb].long()                          # [S, nb]
            step["self_run"] = _arithmetic_run(step["self_pages"].tolist()) if _is_host(meta.block_tables) else None
        pages = step["self_pages"]
        key = ("self_mask", q.dtype)
        if key not in step or step[key][0] is not bias_table:
            step[key] = (bias_table, self._causal_mask(meta, pages.shape[1] * tpb, bias_table, q.dtype))
        mask = step[key][1]                                                                 # [S, H|1, 1, K]
        run = step["self_run"]
        if run is not None:       # the pages lie at evenly spaced runs of the pool: read it in place
            k, v = (_strided_pages(c, pages.shape[0], run, pages.shape[1] * tpb, q.dtype) for c in (k_cache, v_cache))
        else:
            k, v = _gather_pages(k_cache, pages, q.dtype), _gather_pages(v_cache, pages, q.dtype)   # [S, H, K, D]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale)   # [S, H, 1, D]
        return o.squeeze(2)

    @staticmethod
    def _causal_mask(meta, num_keys: int, bias_table, dtype) -> torch.Tensor:
        """Each sequence's one query (the last position) over ``num_keys`` gathered keys."""
        k_pos = torch.arange(num_keys, device=meta.seq_lens.device)
        rel = (meta.seq_lens.long() - 1)[:, None] - k_pos[None, :]                         # [S, K] q - k
        hidden = (rel < 0)[:, None, None, :]                                                # [S, 1, 1, K]
        if bias_table is None:
            mask = torch.zeros(hidden.shape, dtype=dtype, device=rel.device)
        else:
            mask = bias_table[:, rel.clamp(min=0)].to(dtype).transpose(0, 1)[:, :, None, :]   # [S, H, 1, K]
        return mask.masked_fill(hidden, float("-inf")).contiguous()

    def _self_attention_loop(self, q, k_cache, v_cache, meta, scale, bias_table) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = meta.query_start_loc.tolist()
        for i, (qn, sl) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            s = qsl[i]
            k = gather_blocks(k_cache, meta.block_tables[i], sl).transpose(0, 1)   # [H, sl, D]
            v = gather_blocks(v_cache, meta.block_tables[i], sl).transpose(0, 1)
            qi = q[s:s + qn].transpose(0, 1)                                      # [H, qn, D]
            q_pos = torch.arange(sl - qn, sl, device=q.device)
            k_pos = torch.arange(sl, device=q.device)
            rel = q_pos[:, None] - k_pos[None, :]                                 # [qn, sl]
            mask = torch.zeros(rel.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(rel < 0, float("-inf"))
            if bias_table is not None:
                mask = mask + bias_table[:, rel.clamp(min=0)].to(q.dtype)         # [H, qn, sl]
            o = F.scaled_dot_product_attention(qi[None], k.to(q.dtype)[None], v.to(q.dtype)[None],
                                               attn_mask=mask[None], scale=scale)
            out[s:s + qn] = o[0].transpose(0, 1)
        return out

    def cross_attention(self, q, k_cache, v_cache, meta, scale: float, kv_scales=None) -> torch.Tensor:
        if kv_scales is not None:
            return paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.enc_lens,
                                       meta.cross_block_tables, scale, causal=False, kv_scales=kv_scales)
        step = self._step_cache(meta)
        tpb = k_cache.shape[1]
        if "cross" not in step:
            step["cross"] = self._cross_plan(meta, tpb, q.dtype)
        plan = step["cross"]
        if plan["starts"] is not None:
            if step["is_decode"] and plan["groups"] is not None:
                return self._cross_strided(q, k_cache, v_cache, meta, scale, plan, tpb)
            return self._cross_views(q, k_cache, v_cache, meta, scale, plan["starts"], tpb)
        if not step["is_decode"]:
            return self._cross_loop(q, k_cache, v_cache, meta, scale)
        pages = plan["pages"]
        k, v = _gather_pages(k_cache, pages, q.dtype), _gather_pages(v_cache, pages, q.dtype)   # [S, H, K, D]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=plan["mask"], scale=scale)
        return o.squeeze(2)                                                                 # [S, H, D]

    @staticmethod
    def _cross_plan(meta, tpb: int, dtype) -> dict:
        lens = meta.enc_lens_host
        longest = max(lens)
        equal = len(set(lens)) == 1
        starts = None
        if longest >= VIEW_MIN_KEYS or (equal and _is_host(meta.cross_block_tables)):
            starts = _consecutive_starts(meta.cross_block_tables.tolist(), lens, tpb)
        groups = runs = None
        if starts is not None and equal:
            dev = meta.enc_lens.device
            spaced = _spaced_groups(starts)
            if longest < VIEW_MIN_KEYS and len(spaced) > SHORT_VIEW_MAX_GROUPS:
                starts = None     # a short gather and one call beat a call per group
            else:
                groups = [(rows if rows == list(range(rows[0], rows[0] + len(rows))) else torch.tensor(rows, device=dev),
                           first, gap, len(rows)) for rows, first, gap in spaced]
                runs = _shared_runs(starts)
        nb = (longest + tpb - 1) // tpb
        pages = meta.cross_block_tables[:, :nb].long()                                      # [S, nb]
        k_pos = torch.arange(nb * tpb, device=pages.device)
        hidden = (k_pos[None, :] >= meta.enc_lens.long()[:, None])[:, None, None, :]        # [S, 1, 1, K]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=pages.device).masked_fill_(hidden, float("-inf"))
        return {"starts": starts, "pages": pages, "mask": mask, "groups": groups, "runs": runs}

    @staticmethod
    def _cross_strided(q, k_cache, v_cache, meta, scale, plan, tpb) -> torch.Tensor:
        """A decode step over equal-length encoder K/V: one attention call per group of rows whose
        runs of the pool start at evenly spaced blocks (``_spaced_groups``; usually one group),
        each on a strided view [G, H, L, D] of the pool, no copy. Each (row, head) is the same
        flash computation as the per-row loop's: bit for bit on one thread; with several, how
        SDPA splits the keys among threads may differ by CPU (an AVX2 machine rounded ~1e-7
        apart). The loop costs a parallel region per row and layer."""
        length = meta.enc_lens_host[0]
        num_seqs, num_heads, head_dim = q.shape

        def view(count, first, gap):
            return [_strided_pages(c, count, (first, gap), length, q.dtype) for c in (k_cache, v_cache)]   # [G, H, L, D]

        if plan["runs"] is not None:
            # Beams: each run of m rows shares one request's K/V, read once for its m queries.
            count, m, first, gap = plan["runs"]
            kv = view(count, first, gap)
            qg = q.view(count, m, num_heads, head_dim).transpose(1, 2)                          # [G, H, m, D]
            o = F.scaled_dot_product_attention(qg, kv[0], kv[1], scale=scale)                   # [G, H, m, D]
            return o.transpose(1, 2).reshape(num_seqs, num_heads, head_dim)
        out = None
        for rows, first, gap, size in plan["groups"]:
            qg = q[rows[0]:rows[0] + size] if isinstance(rows, list) else q.index_select(0, rows)
            if gap == 0 and size > 1:        # rows on one request's K/V (its beams): one call, `size` queries
                kv = view(1, first, 0)
                o = F.scaled_dot_product_attention(qg.transpose(0, 1)[None], kv[0], kv[1], scale=scale)[0]
                o = o.transpose(0, 1)                                                           # [size, H, D]
            else:
                kv = view(size, first, gap)
                o = F.scaled_dot_product_attention(qg.unsqueeze(2), kv[0], kv[1], scale=scale).squeeze(2)  # [G, H, D]
            if size == num_seqs and isinstance(rows, list):
                return o
            if out is None:
                out = torch.empty_like(q)
            if isinstance(rows, list):
                out[rows[0]:rows[0] + size] = o
            else:
                out.index_copy_(0, rows, o)
        return out

    @staticmethod
    def _cross_views(q, k_cache, v_cache, meta, scale, starts, tpb) -> torch.Tensor:
        out = torch.empty_like(q)
        k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache))             # [slots, H, D]
        qsl = meta.query_start_loc.tolist()
        for i, (qn, el, first) in enumerate(zip(meta.query_lens_host, meta.enc_lens_host, starts)):
            s, base = qsl[i], first * tpb
            k = k_flat[base:base + el].transpose(0, 1)[None].to(q.dtype)                    # [1, H, el, D]
            v = v_flat[base:base + el].transpose(0, 1)[None].to(q.dtype)
            o = F.scaled_dot_product_attention(q[s:s + qn].transpose(0, 1)[None], k, v, scale=scale)
            out[s:s + qn] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _cross_loop(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = meta.query_start_loc.tolist()
        for i, (qn, el) in enumerate(zip(meta.query_lens_host, meta.enc_lens_host)):
            s = qsl[i]
            k = gather_blocks(k_cache, meta.cross_block_tables[i], el).transpose(0, 1)[None]
            v = gather_blocks(v_cache, meta.cross_block_tables[i], el).transpose(0, 1)[None]
            qi = q[s:s + qn].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), scale=scale)
            out[s:s + qn] = o[0].transpose(0, 1)
        return out
