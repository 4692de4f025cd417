"""The ``triton`` attention backend: the four functions of ``engine/models/attention.py``'s
``TorchAttentionBackend`` on the GPU path.

- ``encoder_attention``: one fused ``scaled_dot_product_attention`` over the padded
  batch (key-padding mask, plus the T5 bias); no per-sequence loop.
- ``store_kv``: the Triton slot store (negative slots skipped).
- ``self_attention`` / ``cross_attention``: the Triton paged kernel; on a decode step (one
  token per sequence) self-attention stores the new K/V in the same launch. Any query length per
  sequence is handled in the kernel (one program per query token), so first steps with a
  prefix and recompute after preemption need no fallback.

No host syncs in the decoder functions: the split-K choice reads only the metadata's host
lists and tensor shapes. Without Triton (or on CPU without ``TRITON_INTERPRET=1``) every
kernel falls back to its torch reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_store import store_kv
from .paged_attention import MIN_KEYS_PER_SPLIT, SplitArrivals, paged_attention, pick_num_splits
from .reference import token_seq_index


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, min_keys_per_split: int = MIN_KEYS_PER_SPLIT, last_split_merges: bool = True,
                 store_in_kernel: bool = True):
        self.min_keys_per_split = min_keys_per_split     # split-K floor of the paged kernel (tuning)
        self.last_split_merges = last_split_merges       # the splits merged in the same launch (tuning)
        self.store_in_kernel = store_in_kernel           # decode steps' K/V stored by the attention kernel (tuning)
        self.arrivals = SplitArrivals()     # this engine's own: its decode steps never overlap each other
        self._enc_prep = None     # (meta, bias_table, dtype, prepared): one encoder forward's masks

    def encoder_attention(self, q, k, v, meta, scale: float,
                          bias_table: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional attention over a packed encoder batch; q, k, v: [T, H, D]."""
        num_tokens, num_heads, head_dim = q.shape
        batch, max_len = meta.batch_size, meta.max_seqlen
        prep = self._prepare_encoder(meta, bias_table, q.dtype, q.device, num_tokens)
        if num_tokens == batch * max_len:
            # Equal lengths (every Whisper batch), or the padded layout of an encoder graph
            # (its key-padding mask built from the device lengths): a plain reshape.
            qb, kb, vb = (t.reshape(batch, max_len, num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=prep["mask"], scale=scale)   # [B, H, L, D]
            return o.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
        qb, kb, vb = (t[prep["index"]].transpose(1, 2) for t in (q, k, v))   # [B, H, L, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=prep["mask"], scale=scale)   # [B, H, L, D]
        return o.transpose(1, 2)[prep["seq"], prep["offset"]]                 # [T, H, D]

    def _prepare_encoder(self, meta, bias_table, dtype, device, num_tokens: int) -> dict:
        """The bias, padding mask and gather indices of one encoder microbatch, built at its
        first layer and reused by the others (the same ``meta`` and table objects)."""
        cached = self._enc_prep
        if cached is not None and cached[0] is meta and cached[1] is bias_table and cached[2] == dtype:
            return cached[3]
        batch, max_len = meta.batch_size, meta.max_seqlen
        pos = torch.arange(max_len, device=device)                            # [L]
        bias = None
        if bias_table is not None:
            width = bias_table.shape[1]                                       # 2 * L_table - 1
            rel = (pos[None, :] - pos[:, None] + (width - 1) // 2).clamp(0, width - 1)   # [L, L] k - q
            bias = bias_table[:, rel].to(dtype)[None]                         # [1, H, L, L]
        prep = {"mask": bias}
        lens = None                                                           # [B] real lengths
        if meta.padded_lens is not None:
            lens = meta.padded_lens.long()
        elif num_tokens != batch * max_len:
            cu = meta.cu_seqlens.long()                                       # [B + 1]
            lens = cu[1:] - cu[:-1]
            prep["index"] = (cu[:-1, None] + pos[None, :]).clamp(max=num_tokens - 1)   # [B, L]
            prep["seq"] = token_seq_index(cu, num_tokens)                     # [T]
            prep["offset"] = torch.arange(num_tokens, device=device) - cu[prep["seq"]]   # [T]
        if lens is not None:
            is_pad = pos[None, :] >= lens[:, None]                            # [B, L]
            mask = torch.zeros((batch, 1, 1, max_len), dtype=dtype, device=device)
            mask.masked_fill_(is_pad[:, None, None, :], float("-inf"))        # [B, 1, 1, L]
            prep["mask"] = mask if bias is None else mask + bias              # [B, H|1, L, L]
        self._enc_prep = (meta, bias_table, dtype, prep)
        return prep

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    def self_attention(self, q, k_cache, v_cache, meta, scale: float,
                       bias_table: torch.Tensor | None = None, kv_scales=None, new_kv=None) -> torch.Tensor:
        """Causal attention of the new tokens q [N, H, D] over their sequences' paged K/V.
        ``new_kv``: their (k, v), stored first into ``meta.slot_mapping``; in the attention
        kernel itself when every sequence feeds one token (every sequence feeds at least one,
        so N == S says it), else by ``store_kv``."""
        fused = None
        if new_kv is not None:
            if self.store_in_kernel and q.shape[0] == len(meta.query_lens_host):
                fused = (*new_kv, meta.slot_mapping)
            else:
                store_kv(*new_kv, k_cache, v_cache, meta.slot_mapping, kv_scales)
        splits = pick_num_splits(q.shape[0], q.shape[1], max(meta.seq_lens_host, default=0), q.device,
                                 self.min_keys_per_split)
        return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale, causal=True, bias_table=bias_table, num_splits=splits, kv_scales=kv_scales,
                               last_split_merges=self.last_split_merges, arrivals=self.arrivals, new_kv=fused)

    def cross_attention(self, q, k_cache, v_cache, meta, scale: float, kv_scales=None) -> torch.Tensor:
        """Attention of q [N, H, D] over each request's encoder K/V (no mask beyond enc_len)."""
        splits = pick_num_splits(q.shape[0], q.shape[1], max(meta.enc_lens_host, default=0), q.device,
                                 self.min_keys_per_split)
        return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.enc_lens,
                               meta.cross_block_tables, scale, causal=False, num_splits=splits, kv_scales=kv_scales,
                               last_split_merges=self.last_split_merges, arrivals=self.arrivals)
