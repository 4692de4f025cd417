"""Store new K/V rows into the paged cache: one program per (token, group of heads).

A negative slot marks a padded token (CUDA-graph batches are padded to a captured size)
and writes nothing; the check is a store mask, so the launch needs no host sync. An FP8
pool (``kv_scales`` given) stores each (token, head) row as e4m3 over its own float16
scale, amax / 448, exactly as ``reference.quantize_fp8_ref``.
"""
from __future__ import annotations

from . import can_use_triton, launch_options, lazy_jit, wait_for_previous_kernel
from .reference import store_kv_ref

tl = None  # triton.language, bound by lazy_jit at the first launch (annotations stay strings)


@lazy_jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_heads, tokens_per_block,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    tok = tl.program_id(0).to(tl.int64)   # N x row stride can pass 2**31 (encoder batches)
    # int64: a head-major pool's head stride is a whole layer's pool, so head x stride can pass
    # 2**31 elements (pools over 4 GiB)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # [BLOCK_H]
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
    if FP8:
        # scale tensors [num_blocks, tokens_per_block, heads], any strides
        dst_s = page * stride_sb + in_page * stride_st + offs_h * stride_sh
        mask_s = (slot >= 0) & (offs_h < num_heads)
        _store_fp8(k.to(tl.float32), dst_k, k_scale_ptr + dst_s, mask, mask_s)
        _store_fp8(v.to(tl.float32), dst_v, v_scale_ptr + dst_s, mask, mask_s)
    else:
        tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@lazy_jit.helper
def _store_fp8(x, dst, dst_scale, mask, mask_s):
    # x [BLOCK_H, BLOCK_D] fp32 (masked lanes 0): one scale per head row, rounded to the
    # stored float16 first so that values * stored scale is what the row holds.
    # 448 and 2**-14: reference.FP8_MAX and FP8_MIN_SCALE (a jit function reads no globals)
    amax = tl.max(tl.abs(tl.where(mask, x, 0.0)), axis=1)                     # [BLOCK_H]
    scale = tl.maximum(amax / 448.0, 6.103515625e-05).to(dst_scale.dtype.element_ty)
    scaled = x / scale.to(tl.float32)[:, None]
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    tl.store(dst, scaled.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_scale, scale, mask=mask_s)


def store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
    """Write ``k, v [N, H, D]`` into ``k_cache, v_cache [num_blocks, tokens_per_block, H, D]``.

    ``slot_mapping [N]`` (int64): slot ``s`` is block ``s // tokens_per_block``, offset
    ``s % tokens_per_block``; ``s < 0`` skips the token. ``k``/``v`` may be strided views
    (e.g. slices of a fused QKV output) as long as ``head_dim`` is contiguous. ``kv_scales``:
    (k_scale, v_scale) [num_blocks, tokens_per_block, H] float16 of an FP8 pool.
    """
    if not can_use_triton(k, v, k_cache, v_cache, slot_mapping):
        return store_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    num_tokens, num_heads, head_dim = k.shape
    assert k_cache.shape[2:] == (num_heads, head_dim) and v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if num_tokens == 0:
        return None
    block_d = 1 << (head_dim - 1).bit_length()
    block_h = min(1 << (num_heads - 1).bit_length(), max(1, 4096 // block_d))
    grid = (num_tokens, (num_heads + block_h - 1) // block_h)
    fp8 = kv_scales is not None
    k_scale, v_scale = kv_scales if fp8 else (k_cache, v_cache)               # unused pointers
    if fp8:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, num_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, k_scale.stride(2) if fp8 else 0,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, num_warps=4, **launch_options(k),
    )
    return None
