"""Store new K/V rows into the paged cache: one program per (token, group of heads).

A negative slot marks a padded token (CUDA-graph batches are padded to a captured size)
and writes nothing; the check is a store mask, so the launch needs no host sync.
"""
from __future__ import annotations

from . import can_use_triton, lazy_jit
from .reference import store_kv_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)


@lazy_jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_heads, tokens_per_block,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)   # N x row stride can pass 2**31 (encoder batches)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)            # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)                                         # [BLOCK_D]
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    mask = (slot >= 0) & (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    page = slot // tokens_per_block
    in_page = slot % tokens_per_block
    src_k = k_ptr + tok * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + tok * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = k_cache_ptr + page * stride_kcb + in_page * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = v_cache_ptr + page * stride_vcb + in_page * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write ``k, v [N, H, D]`` into ``k_cache, v_cache [num_blocks, tokens_per_block, H, D]``.

    ``slot_mapping [N]`` (int64): slot ``s`` is block ``s // tokens_per_block``, offset
    ``s % tokens_per_block``; ``s < 0`` skips the token. ``k``/``v`` may be strided views
    (e.g. slices of a fused QKV output) as long as ``head_dim`` is contiguous.
    """
    if not can_use_triton(k, v, k_cache, v_cache, slot_mapping):
        return store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    assert k_cache.shape[2:] == (num_heads, head_dim) and v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if num_tokens == 0:
        return None
    block_d = 1 << (head_dim - 1).bit_length()
    block_h = min(1 << (num_heads - 1).bit_length(), max(1, 4096 // block_d))
    grid = (num_tokens, (num_heads + block_h - 1) // block_h)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, num_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return None
