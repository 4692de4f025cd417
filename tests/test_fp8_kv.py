"""The FP8 KV cache (``kv_cache_config.dtype="fp8"``): the store kernel quantises each
(token, head) row over its own scale as ``reference.quantize_fp8_ref`` does, the paged
attention kernel reads e4m3 values with their scales as the reference dequantises them,
and the quantisation itself stays within e4m3's precision.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1);
``test_kernels_gpu.py`` runs them compiled.
"""
import importlib.util

import pytest
import torch

from enc2dec.kernels import reference as ref

HAS_TRITON = importlib.util.find_spec("triton") is not None   # find, not import: TRITON_INTERPRET is read then
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def fp8_pool(num_blocks, tokens_per_block, heads, head_dim, device=DEVICE):
    cache = torch.zeros(num_blocks, tokens_per_block, heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.zeros(num_blocks, tokens_per_block, heads, dtype=ref.FP8_SCALE_DTYPE, device=device)
    return cache, scale


def test_quantisation_error_is_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, and an all-zero row (its scale must stay finite)
    x = torch.randn(6, 4, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 500.0, 1e4, 0.0])[:, None, None]
    q, scale = ref.quantize_fp8_ref(x)
    back = ref.dequantize_ref(q, scale)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == ref.FP8_SCALE_DTYPE
    assert bool(torch.isfinite(back).all()) and bool((back[5] == 0).all())
    # e4m3 keeps 3 mantissa bits: at most 1/16 relative error per element near a row's amax
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert bool(((back - x).abs() <= amax / 16 + 1e-6).all())
    assert float(q.float().abs().amax()) <= ref.FP8_MAX


@needs_triton
def test_store_kernel_writes_what_the_reference_writes():
    from enc2dec.kernels.kv_store import store_kv

    g = torch.Generator().manual_seed(1)
    heads, head_dim, tpb = 3, 64, 16
    k = (torch.randn(7, heads, head_dim, generator=g) * torch.linspace(0.01, 40, 7)[:, None, None]).to(DEVICE)
    v = torch.randn(7, heads, head_dim, generator=g).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 40, 2, -1, 63], device=DEVICE)      # padding slots skip
    got = [fp8_pool(4, tpb, heads, head_dim) for _ in range(2)]
    want = [fp8_pool(4, tpb, heads, head_dim) for _ in range(2)]
    store_kv(k, v, got[0][0], got[1][0], slots, kv_scales=(got[0][1], got[1][1]))
    ref.store_kv_ref(k, v, want[0][0], want[1][0], slots, kv_scales=(want[0][1], want[1][1]))
    for (gc, gs), (wc, ws) in zip(got, want):
        assert torch.equal(gs, ws)
        # the same e4m3 byte, or its neighbour where a division rounded the other way
        assert int((gc.view(torch.uint8).int() - wc.view(torch.uint8).int()).abs().max()) <= 1
    untouched = torch.ones(4 * tpb, dtype=torch.bool)
    untouched[[5, 17, 40, 2, 63]] = False
    assert bool((got[0][1].view(-1, heads)[untouched.to(DEVICE)] == 0).all())


@needs_triton
@pytest.mark.parametrize("causal,splits", [(True, 1), (True, 4), (False, 2)])
def test_paged_attention_reads_fp8_pools_as_the_reference(causal, splits):
    from enc2dec.kernels.paged_attention import paged_attention
    from test_kernels import make_paged_case

    kv_lens, q_lens = [17, 40, 5], [1, 2, 1]
    case = make_paged_case(kv_lens, q_lens, 2, 64, seed=3)
    caches, exact_caches = [], []
    for name in ("k_cache", "v_cache"):      # blocks of different magnitudes
        x = case[name] * torch.linspace(0.1, 8, case[name].shape[0], device=DEVICE)[:, None, None, None]
        caches.append(ref.quantize_fp8_ref(x))
        exact_caches.append(x)
    (k8, ks), (v8, vs) = caches
    args = (case["q"], k8, v8, case["query_start_loc"], case["kv_lens"], case["block_tables"])
    bias = case["bias"] if causal else None
    got = paged_attention(*args, 0.125, causal=causal, bias_table=bias, num_splits=splits, kv_scales=(ks, vs))
    want = ref.paged_attention_ref(*args, 0.125, causal=causal, bias_table=bias, kv_scales=(ks, vs))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and the FP8 result is close to attention over the unquantised cache
    exact = ref.paged_attention_ref(case["q"], *exact_caches, *args[3:], 0.125, causal=causal, bias_table=bias)
    assert float((got - exact).abs().max()) < 0.1 * float(exact.abs().max())


def _dequant(x):
    q, scale = ref.quantize_fp8_ref(x)
    return q.float() * scale.float()[..., None]


def test_centred_cross_keys_keep_attention_and_quantise_closer():
    # Two encoder sequences in the padded layout (8 positions each, the last 3 and 1 padding),
    # keys with a channel that is large at every position, as real encoders' keys have.
    from types import SimpleNamespace

    from enc2dec.engine.models.layers import EncoderSegments

    g = torch.Generator().manual_seed(0)
    heads, dim, lens = 2, 32, (5, 7)
    slots = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8, 9, 10, 11, -1])
    meta = SimpleNamespace(cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32), cross_slot_mapping=slots)
    k = torch.randn(16, heads, dim, generator=g)
    k[:, :, 3] += 40.0
    k[:, 1, 7] -= 25.0
    k[slots < 0] = 1e4                            # padding is garbage: it must not move any mean
    centred = EncoderSegments(meta).center(k)
    q = torch.randn(heads, dim, generator=g)
    for s, (start, n) in enumerate(zip((0, 8), lens)):
        real, cent = k[start:start + n], centred[start:start + n]
        assert float(cent.mean(dim=0).abs().max()) < 1e-4
        for keys in (real, cent):
            assert torch.isfinite(keys).all()
        exact = torch.softmax(torch.einsum("hd,thd->ht", q, real) * 0.2, dim=-1)
        torch.testing.assert_close(torch.softmax(torch.einsum("hd,thd->ht", q, cent) * 0.2, dim=-1), exact,
                                   atol=1e-5, rtol=1e-4)
        # the same scores from FP8 keys: centred ones come out closer to the exact attention
        err = [float((torch.softmax(torch.einsum("hd,thd->ht", q, _dequant(x)) * 0.2, dim=-1) - exact).abs().max())
               for x in (real, cent)]
        assert err[1] < err[0] / 2, err
