"""Each Triton kernel against its torch reference, and the triton backend against the torch one.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
conftest.py before anything imports triton; kernels are decorated at first launch, so it takes
effect then); with CUDA the same cases run compiled on the GPU (``test_kernels_gpu.py``
adds bf16 and larger shapes there). Every output buffer a kernel writes, including
split-K partials, starts as NaN, so an unwritten element fails.
"""
import importlib.util
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # find, not import: TRITON_INTERPRET is read at import
    pytest.skip("triton is not installed", allow_module_level=True)

from enc2dec import kernels
from enc2dec.engine.models.attention import (
    DecoderMetadata,
    EncoderMetadata,
    TorchAttentionBackend,
)
from enc2dec.kernels import reference as ref
from enc2dec.kernels.activations import gated_gelu, gelu
from enc2dec.kernels.backend import TritonAttentionBackend
from enc2dec.kernels.kv_store import store_kv
from enc2dec.kernels.norms import fused_add_layer_norm, fused_add_rms_norm
from enc2dec.kernels.paged_attention import paged_attention
from enc2dec.kernels import skinny_gemm
from enc2dec.kernels.skinny_gemm import Prologue, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 math in kernel and reference; only summation order differs.
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled floats, so unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def assert_close(actual, expected, dtype):
    assert torch.isfinite(actual).all(), "output has unwritten (NaN) elements"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def make_paged_case(kv_lens, q_lens, num_heads, head_dim, *, tokens_per_block=16, dtype=torch.float32,
                    device=DEVICE, seed=0, pad_tokens=0):
    """Random cache, shuffled non-contiguous block tables (one spare column), packed q."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // tokens_per_block) for n in kv_lens]
    width = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks, generator=g)[: sum(blocks_per_seq)]
    tables = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, tokens_per_block, num_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens) + pad_tokens, num_heads, head_dim, generator=g).to(dtype)
    bias = torch.randn(num_heads, max(kv_lens) + 8, generator=g)
    case = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "query_start_loc": qsl,
            "kv_lens": torch.tensor(kv_lens, dtype=torch.int32), "block_tables": tables, "bias": bias}
    return {name: t.to(device) for name, t in case.items()}


def check_paged(case, *, causal, use_bias, num_splits, scale=0.125, dtype=torch.float32):
    args = [case[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "kv_lens", "block_tables")]
    bias = case["bias"] if use_bias else None
    out = torch.full_like(case["q"], float("nan"))
    got = paged_attention(*args, scale, causal=causal, bias_table=bias, out=out, num_splits=num_splits)
    assert got is out
    expected = ref.paged_attention_ref(*args, scale, causal=causal, bias_table=bias)
    assert_close(out, expected, dtype)
    return out


PAGED_CASES = [  # kv_lens, q_lens, heads, head_dim, tokens_per_block, splits, causal, bias
    ([1], [1], 2, 64, 16, 1, True, False),
    ([17, 33, 5], [1, 1, 1], 2, 64, 16, 1, True, True),
    ([1, 16, 31, 47, 2, 64, 9], [1, 3, 1, 4, 2, 1, 1], 2, 128, 16, 4, True, True),
    ([40, 21], [40, 3], 1, 64, 32, 2, True, True),                         # recompute after preemption
    ([23, 50, 7], [1, 2, 1], 2, 64, 16, 2, False, False),                  # cross attention
    ([100, 37], [2, 1], 1, 80, 64, None, True, True),                      # odd head_dim, auto splits
    ([70, 9, 130], [1, 1, 2], 1, 256, 16, 3, False, False),
    ([33, 5], [1, 1], 3, 16, 16, 16, True, True),                          # more splits than tiles
    ([9, 20, 14, 30], [1, 0, 2, 1], 2, 64, 16, 2, True, True),             # an empty sequence
]


@pytest.mark.parametrize("kv_lens,q_lens,heads,head_dim,tpb,splits,causal,bias", PAGED_CASES)
def test_paged_attention_matches_reference(kv_lens, q_lens, heads, head_dim, tpb, splits, causal, bias):
    case = make_paged_case(kv_lens, q_lens, heads, head_dim, tokens_per_block=tpb, seed=len(kv_lens) + head_dim)
    check_paged(case, causal=causal, use_bias=bias, num_splits=splits, scale=1.0 if bias else head_dim ** -0.5)


@pytest.mark.parametrize("splits", [1, 8])
def test_paged_attention_whisper_length_cross(splits):
    case = make_paged_case([1500, 1500], [1, 4], 1, 64, seed=splits)
    check_paged(case, causal=False, use_bias=False, num_splits=splits)


@pytest.mark.parametrize("causal,splits", [(True, 4), (False, 2), (False, 16)])
def test_paged_attention_last_split_merges_as_the_merge_kernel(causal, splits):
    """The last split of each (token, head) merging in the same launch gives the merge kernel's
    output bit for bit, launch after launch (its arrival counts are back at zero after each)."""
    from enc2dec.kernels.paged_attention import SplitArrivals

    arrivals = SplitArrivals()
    case = make_paged_case([1500, 90, 7, 300], [1, 1, 2, 1], 3, 64, seed=21)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "kv_lens", "block_tables")]
    bias = case["bias"] if causal else None
    two_kernels = paged_attention(*args, 0.125, causal=causal, bias_table=bias, num_splits=splits,
                                  last_split_merges=False)
    assert_close(two_kernels, ref.paged_attention_ref(*args, 0.125, causal=causal, bias_table=bias), torch.float32)
    for _ in range(2):
        one_kernel = paged_attention(*args, 0.125, causal=causal, bias_table=bias, num_splits=splits,
                                     last_split_merges=True, arrivals=arrivals)
        assert torch.equal(one_kernel, two_kernels)
        assert not arrivals.held[one_kernel.device][-1].any()


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored [heads, blocks, positions(, head_dim)], seen in the usual shape
    (``KVCache.allocate``'s head-major pools; an FP8 pool's scales too)."""
    return cache.movedim(2, 0).contiguous().movedim(0, 2)


@pytest.mark.parametrize("causal,splits", [(False, 1), (False, 4), (True, 2)])
def test_paged_attention_reads_head_major_pools_as_token_major_ones(causal, splits):
    """The kernel follows the pools' strides: head-major storage gives the token-major result bit
    for bit (the same kernel arithmetic) and the reference's within tolerance."""
    case = make_paged_case([1500, 700, 33], [1, 1, 2], 3, 64, seed=13)
    expected = check_paged(case, causal=causal, use_bias=False, num_splits=splits)
    hm = {**case, "k_cache": _head_major(case["k_cache"]), "v_cache": _head_major(case["v_cache"])}
    assert hm["k_cache"].stride(2) == hm["k_cache"].shape[0] * 16 * 64           # heads outermost
    got = check_paged(hm, causal=causal, use_bias=False, num_splits=splits)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_reads_head_major_fp8_pools_and_scales(splits):
    """FP8 pools with their scales head-major: the token-major pools' result bit for bit."""
    case = make_paged_case([1500, 300], [1, 2], 3, 64, seed=14)
    (k8, ks), (v8, vs) = (ref.quantize_fp8_ref(case[name]) for name in ("k_cache", "v_cache"))
    args = (case["q"], case["query_start_loc"], case["kv_lens"], case["block_tables"])

    def run(k, v, scales):
        return paged_attention(args[0], k, v, *args[1:], 0.125, causal=False, num_splits=splits, kv_scales=scales)
    want = run(k8, v8, (ks, vs))
    got = run(_head_major(k8), _head_major(v8), (_head_major(ks), _head_major(vs)))
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_store_kv_writes_head_major_pools(fp8):
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(20, 3, 64, generator=g).to(DEVICE) for _ in range(2))
    slots = torch.randperm(4 * 16, generator=g)[:20].to(DEVICE)
    dtype = torch.float8_e4m3fn if fp8 else torch.float32

    def pools(major):
        make = _head_major if major else (lambda t: t)
        values = [make(torch.zeros(4, 16, 3, 64, device=DEVICE).to(dtype)) for _ in range(2)]
        scales = [make(torch.zeros(4, 16, 3, device=DEVICE, dtype=ref.FP8_SCALE_DTYPE)) for _ in range(2)]
        store_kv(k, v, *values, slots, kv_scales=tuple(scales) if fp8 else None)
        return values + (scales if fp8 else [])
    token_major, head_major = pools(False), pools(True)
    for a, b in zip(head_major, token_major):
        assert b.float().abs().sum() > 0 and torch.equal(a.float(), b.float())


def _new_token_slots(case, kv_lens, pad_rows=0):
    """Each sequence's last position's slot (its one new token), -1 for padding rows."""
    tpb = case["k_cache"].shape[1]
    slots = [int(case["block_tables"][i, (n - 1) // tpb]) * tpb + (n - 1) % tpb for i, n in enumerate(kv_lens)]
    return torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64, device=case["q"].device)


def check_store_in_attention(kv_lens, heads, splits, fp8, head_major, *, dtype=torch.float32, device=DEVICE,
                             seed=31):
    """A decode step's self-attention given the new K/V stores them itself: the pools (and an
    FP8 pool's scales) and the output equal ``store_kv`` followed by the attention, bit for bit,
    whichever split holds each token's last key; a padding row (slot -1, the last) writes nothing."""
    n = len(kv_lens) + 1
    case = make_paged_case(kv_lens + [1], [1] * n, heads, 64, dtype=dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    new_k, new_v = (torch.randn(n, heads, 64, generator=g).to(dtype).to(device) for _ in range(2))
    slots = _new_token_slots(case, kv_lens, pad_rows=1)
    pools = [case["k_cache"], case["v_cache"]]
    scales = None
    if fp8:
        (k8, ks), (v8, vs) = (ref.quantize_fp8_ref(t) for t in pools)
        pools, scales = [k8, v8], [ks, vs]
    if head_major:
        pools = [_head_major(t) for t in pools]
        scales = [_head_major(t) for t in scales] if scales else None
    args = (case["query_start_loc"], case["kv_lens"], case["block_tables"], 0.125)

    def run(fused):
        k_c, v_c = (t.clone() for t in pools)
        sc = tuple(t.clone() for t in scales) if scales else None
        if not fused:
            store_kv(new_k, new_v, k_c, v_c, slots, kv_scales=sc)
        out = paged_attention(case["q"], k_c, v_c, *args, causal=True, bias_table=case["bias"], num_splits=splits,
                              kv_scales=sc, new_kv=(new_k, new_v, slots) if fused else None)
        return [out, k_c, v_c, *(sc or ())]
    want, got = run(False), run(True)
    assert not torch.equal(want[1].float(), pools[0].float())          # the store changed the pool
    for a, b in zip(got, want):
        assert torch.equal(a.float(), b.float())
    assert torch.isfinite(got[0]).all()


@pytest.mark.parametrize("splits,fp8,head_major", [(1, False, False), (4, False, False), (2, True, False),
                                                   (4, False, True), (16, True, True)])
def test_paged_attention_stores_the_new_tokens_as_store_kv_does(splits, fp8, head_major):
    # The interpreter runs a launch's programs one after another, so it checks what is stored
    # and read, not that the program reading a token's new key is the one that stored it
    # (test_kernels_gpu.py runs the same check on the GPU, where the programs race).
    check_store_in_attention([1, 17, 33, 64, 100], 3, splits, fp8, head_major)


def test_backend_self_attention_stores_new_kv_on_decode_and_prefix_steps():
    """``self_attention(..., new_kv=(k, v))``: one launch on a decode step, the store kernel first on a
    step that feeds a prefix; both the torch backend's pools and output."""
    for q_lens, kv_lens in (([1, 1, 1], [13, 20, 1]), ([1, 3, 1], [13, 20, 2])):
        case = make_paged_case(kv_lens, q_lens, 2, 64, seed=23)
        meta = decoder_meta(case, q_lens, kv_lens)
        tpb = case["k_cache"].shape[1]
        meta.slot_mapping = torch.tensor(
            [int(case["block_tables"][i, p // tpb]) * tpb + p % tpb
             for i, (qn, n) in enumerate(zip(q_lens, kv_lens)) for p in range(n - qn, n)], device=DEVICE)
        g = torch.Generator().manual_seed(24)
        new_k, new_v = (torch.randn(case["q"].shape, generator=g).to(DEVICE) for _ in range(2))
        results = []
        for backend in (TritonAttentionBackend(store_in_kernel=True), TritonAttentionBackend(store_in_kernel=False),
                        TorchAttentionBackend()):
            k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
            out = backend.self_attention(case["q"], k_cache, v_cache, meta, 1.0, case["bias"], new_kv=(new_k, new_v))
            results.append((out, k_cache, v_cache))
        (o_tri, k_tri, v_tri), *others = results
        assert not torch.equal(k_tri, case["k_cache"])
        for o, k, v in others:            # the store kernel first, and the torch backend
            assert torch.equal(k_tri, k) and torch.equal(v_tri, v)
            assert_close(o_tri, o, torch.float32)


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_attention_padding_tokens_get_zeros(splits):
    case = make_paged_case([12, 30], [1, 2], 2, 64, seed=3, pad_tokens=2)
    out = check_paged(case, causal=True, use_bias=True, num_splits=splits)
    assert (out[3:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_precision(dtype):
    case = make_paged_case([29, 64, 3], [1, 2, 1], 2, 64, dtype=dtype, seed=11)
    check_paged(case, causal=True, use_bias=True, num_splits=2, scale=1.0, dtype=dtype)


def test_reference_matches_torch_backend():
    """The vectorised reference agrees with engine/models/attention.py's per-sequence loop."""
    case = make_paged_case([9, 40, 17], [1, 3, 2], 2, 64, seed=5)
    meta = decoder_meta(case, [1, 3, 2], [9, 40, 17])
    for causal, bias in ((True, case["bias"]), (False, None)):
        args = [case[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "kv_lens", "block_tables")]
        got = ref.paged_attention_ref(*args, 1.0, causal=causal, bias_table=bias)
        torch_backend = TorchAttentionBackend()
        if causal:
            expected = torch_backend.self_attention(case["q"], case["k_cache"], case["v_cache"], meta, 1.0, bias)
        else:
            expected = torch_backend.cross_attention(case["q"], case["k_cache"], case["v_cache"], meta, 1.0)
        assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_store_kv_matches_reference_and_skips_padding(dtype, cache_dtype):
    g = torch.Generator().manual_seed(7)
    num_tokens, heads, head_dim, tpb, num_blocks = 9, 3, 64, 16, 6
    qkv = torch.randn(num_tokens, 3, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]                                             # strided views
    slots = torch.randperm(num_blocks * tpb, generator=g)[:num_tokens]
    slots[[2, 5]] = -1                                                      # padded tokens
    slots = slots.to(DEVICE)
    shape = (num_blocks, tpb, heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    ref.store_kv_ref(k, v, k_ref, v_ref, slots)
    # a copy (a downcast rounds to nearest even, as torch's does): exact
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)
    assert torch.isnan(k_cache).flatten(0, 1).all(-1).all(-1).sum() == num_blocks * tpb - (num_tokens - 2)


NORM_SHAPES = [(1, 64), (7, 130), (3, 5, 96)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norms_match_reference(shape, dtype, with_residual):
    g = torch.Generator().manual_seed(sum(shape))
    x, residual = (torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    residual = residual if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    bias = (0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    for fn, fn_ref, extra in ((fused_add_rms_norm, ref.fused_add_rms_norm_ref, ()),
                              (fused_add_layer_norm, ref.fused_add_layer_norm_ref, (bias,))):
        normed, new_res = fn(x, residual, weight, *extra, 1e-6)
        normed_ref, new_res_ref = fn_ref(x, residual, weight, *extra, 1e-6)
        assert normed.shape == x.shape and normed.dtype == x.dtype
        assert_close(normed, normed_ref, dtype)
        assert_close(new_res, new_res_ref, dtype)


@pytest.mark.parametrize("shape", [(1, 8), (5, 74), (2, 3, 2200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_match_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (4 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    x[..., 0] = 30.0                                                        # tanh saturation
    for approximate in ("none", "tanh"):
        assert_close(gelu(x, approximate), ref.gelu_ref(x, approximate), dtype)
        got = gated_gelu(x, approximate)
        assert got.shape == (*shape[:-1], shape[-1] // 2)
        assert_close(got, ref.gated_gelu_ref(x, approximate), dtype)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate='fast'.*none, tanh"):
        gelu(torch.randn(2, 4, device=DEVICE), "fast")


def decoder_meta(case, q_lens, kv_lens, enc_case=None):
    cross = enc_case or case
    qsl = case["query_start_loc"]
    last = (qsl[1:] - 1).long()
    return DecoderMetadata(
        query_start_loc=qsl, seq_lens=case["kv_lens"], block_tables=case["block_tables"],
        slot_mapping=torch.zeros(0, dtype=torch.int64), cross_block_tables=cross["block_tables"],
        enc_lens=cross["kv_lens"], query_lens_host=list(q_lens), seq_lens_host=list(kv_lens),
        enc_lens_host=cross["kv_lens"].tolist(), last_token_indices=last)


def check_backend_decode(case, enc_case, q_lens, kv_lens, dtype, tol_dtype=None):
    """store_kv + self_attention + cross_attention through both backends."""
    tol_dtype = tol_dtype or dtype
    meta = decoder_meta(case, q_lens, kv_lens, enc_case)
    tpb = case["k_cache"].shape[1]
    slots = []
    for i, (qn, n) in enumerate(zip(q_lens, kv_lens)):                      # the new tokens' slots
        for p in range(n - qn, n):
            slots.append(int(case["block_tables"][i, p // tpb]) * tpb + p % tpb)
    slots = torch.tensor(slots, dtype=torch.int64, device=case["q"].device)
    qkv = torch.stack([case["q"], torch.randn_like(case["q"]), torch.randn_like(case["q"])], dim=1)
    q, new_k, new_v = qkv.unbind(1)                      # strided [N, H, D] views, as the models pass them
    results = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        backend.store_kv(new_k, new_v, k_cache, v_cache, slots)
        self_out = backend.self_attention(q, k_cache, v_cache, meta, 1.0, case["bias"])
        cross_out = backend.cross_attention(q, enc_case["k_cache"], enc_case["v_cache"], meta, 0.125)
        results.append((k_cache, self_out, cross_out))
    (k_tri, self_tri, cross_tri), (k_torch, self_torch, cross_torch) = results
    torch.testing.assert_close(k_tri, k_torch, atol=0, rtol=0)
    assert_close(self_tri, self_torch, tol_dtype)
    assert_close(cross_tri, cross_torch, tol_dtype)


def test_backend_decode_matches_torch_backend():
    q_lens, kv_lens = [1, 2, 1], [13, 20, 1]
    case = make_paged_case(kv_lens, q_lens, 2, 64, seed=21)
    enc_case = make_paged_case([30, 45, 8], q_lens, 2, 64, seed=22)
    check_backend_decode(case, enc_case, q_lens, kv_lens, torch.float32)


def encoder_meta(seq_lens, device=DEVICE):
    cu = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return EncoderMetadata(cu_seqlens=cu, seq_lens=list(seq_lens), positions=None,
                           cross_slot_mapping=torch.zeros(0, dtype=torch.int64, device=device))


@pytest.mark.parametrize("seq_lens", [[5, 9, 3], [6, 6], [1]])
@pytest.mark.parametrize("with_bias", [True, False])
def test_backend_encoder_attention_matches_torch_backend(seq_lens, with_bias):
    g = torch.Generator().manual_seed(len(seq_lens))
    q, k, v = (torch.randn(sum(seq_lens), 2, 64, generator=g).to(DEVICE) for _ in range(3))
    bias = torch.randn(2, 2 * 16 - 1, generator=g).to(DEVICE) if with_bias else None
    meta = encoder_meta(seq_lens)
    got = TritonAttentionBackend().encoder_attention(q, k, v, meta, 1.0, bias)
    expected = TorchAttentionBackend().encoder_attention(q, k, v, meta, 1.0, bias)
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("rows,n,k", [(1, 37, 100), (3, 64, 257), (8, 4100, 96), (16, 9, 600), (5, 1, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_matches_reference(rows, n, k, with_bias, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype) / k ** 0.5
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    got = skinny_linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close(got, ref.skinny_linear_ref(x.float(), w.float(), None if b is None else b.float()), dtype)


_FUSIONS = {   # name -> (norm prologue: (kind, with residual, with bias) or None, (activation, gated) or None)
    "plain": (None, None), "rms": (("rms", False, False), None), "rms+residual": (("rms", True, False), None),
    "layer+residual": (("layer", True, True), None), "layer": (("layer", False, False), None),
    "gelu": (None, ("gelu", False)), "gated gelu_tanh": (None, ("gelu_tanh", True)), "relu": (None, ("relu", False)),
    "rms+residual, gated gelu_tanh": (("rms", True, False), ("gelu_tanh", True)),      # a T5 MLP's first GEMV
    "layer+residual, gelu": (("layer", True, True), ("gelu", False)),                   # a Whisper MLP's
}


def _fused_case(name, rows, n, k, dtype, g):
    norm, act = _FUSIONS[name]
    x = (torch.randn(rows, k, generator=g) + 0.5).to(DEVICE, dtype)               # mean 0.5: LayerNorm centres
    kwargs = {}
    if norm:
        kind, with_res, with_bias = norm
        kwargs = dict(norm=kind, eps=1e-5, norm_weight=(1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype))
        if with_res:
            kwargs["residual"] = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        if with_bias:
            kwargs["norm_bias"] = torch.randn(k, generator=g).to(DEVICE, dtype)
    width = 2 * n if act and act[1] else n
    w = (torch.randn(width, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, dtype)
    make = (lambda: Prologue(x, **kwargs)) if norm else (lambda: x)
    return make, w, b, dict(act=act[0], gated=act[1]) if act else {}


def check_fused(name, rows, n, k, dtype, exact_residual=False, product=None):
    """A deferred norm (+ residual add) and an output activation (gated: act(gate) * up)
    computed inside the GEMV (or ``product``) give what the separate kernels around the product
    give, and the whole new residual is written (bit for bit with ``exact_residual``)."""
    g = torch.Generator().manual_seed(rows * 7 + k)
    make, w, b, act = _fused_case(name, rows, n, k, dtype, g)
    fused, unfused = make(), make()
    got = (product or skinny_linear)(fused, w, b, **act)
    inputs = unfused.materialize() if isinstance(unfused, Prologue) else unfused
    expected = ref.skinny_linear_ref(inputs.float(), w.float(), b.float())
    if act:
        expected = skinny_gemm.activation_ref(expected.to(dtype), act["act"], act["gated"])
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close(got, expected, dtype)
    if isinstance(fused, Prologue) and fused.residual is not None:   # program 0 wrote x + residual, all of it
        if exact_residual:
            assert torch.equal(fused.res_out, unfused.res_out)
        else:
            assert_close(fused.res_out, unfused.res_out, dtype)


@pytest.mark.parametrize("name", list(_FUSIONS))
@pytest.mark.parametrize("rows,n,k", [(1, 37, 100), (3, 20, 1300)])      # 1300 with 3 rows: statistics in pieces
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_fuses_the_norm_before_it_and_the_activation_after_it(name, rows, n, k, dtype):
    check_fused(name, rows, n, k, dtype, exact_residual=True)


@pytest.mark.parametrize("name", list(_FUSIONS))
@pytest.mark.parametrize("rows,n,k", [(5, 40, 128), (70, 24, 100), (9, 24, 1300)])    # 70 rows: two row tiles;
# K 100: a masked piece; K 1300: a LayerNorm's statistics merged over 21 pieces
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_linear_fuses_the_norm_before_it_and_the_activation_after_it(name, rows, n, k, dtype):
    from enc2dec.kernels.tile_gemm import tile_linear

    check_fused(name, rows, n, k, dtype, exact_residual=True, product=tile_linear)


@pytest.mark.parametrize("name,rows,n,k,split", [("plain", 17, 40, 128, 2), ("gelu", 64, 48, 256, 4),
                                                  ("gated gelu_tanh", 5, 20, 96, 3), ("plain", 70, 24, 200, 3),
                                                  ("rms+residual, gated gelu_tanh", 9, 24, 160, 2), ("rms", 40, 32, 192, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_linear_split_over_k_gives_the_unsplit_product(name, rows, n, k, split, dtype, monkeypatch):
    """K in pieces (SPLIT_K programs a tile, the last to finish adds their float32 partials in
    order): the product, activation and residual of the unsplit kernel, the same bits on every
    launch whichever program finishes last, and the tiles' counters back at zero for the next."""
    from enc2dec.kernels import tile_gemm

    g = torch.Generator().manual_seed(rows * 11 + k)
    make, w, b, act = _fused_case(name, rows, n, k, dtype, g)
    config = (32, 16, 32, 4, 2)
    whole, first, again, reversed_ = make(), make(), make(), make()
    expected = tile_gemm.tile_linear(whole, w, b, **act, config=config + (1,))
    got = tile_gemm.tile_linear(first, w, b, **act, config=config + (split,))
    assert_close(got, expected, dtype)
    assert torch.equal(tile_gemm.tile_linear(again, w, b, **act, config=config + (split,)), got)
    if DEVICE == "cpu":
        # the interpreter runs programs in grid order, so the last piece's program adds the
        # partials; run the pieces last to first, so the first piece's program does
        from triton.runtime import interpreter

        builder, dims = interpreter.interpreter_builder, {}
        set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
        monkeypatch.setattr(builder, "set_grid_dim", lambda *d: (dims.update(d=d), set_dim(*d))[1])
        monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(x, y, dims["d"][2] - 1 - z))
        assert torch.equal(tile_gemm.tile_linear(reversed_, w, b, **act, config=config + (split,)), got)
    if isinstance(first, Prologue) and first.residual is not None:
        assert torch.equal(first.res_out, whole.res_out)
    pool = tile_gemm._COUNTS[w.device]
    assert pool["used"] > 0 and not pool["pool"].any()


def check_qkv_store(rows, slots, dtype, heads=3, head_dim=5, d=70, blocks=3, tpb=4):
    """The q|k|v projection with ``kv_store`` returns the product and writes its k and v
    thirds at each row's slot (a negative slot nowhere), exactly as ``store_kv`` after it."""
    g = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, d, generator=g).to(DEVICE, dtype)
    w = (torch.randn(3 * heads * head_dim, d, generator=g) / d ** 0.5).to(DEVICE, dtype)
    b = torch.randn(3 * heads * head_dim, generator=g).to(DEVICE, dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    caches = [torch.randn(blocks, tpb, heads, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    got = skinny_linear(x, w, b, kv_store=(caches[0], caches[1], slot_mapping))
    expected = ref.skinny_linear_ref(x.float(), w.float(), b.float()).to(dtype)
    assert_close(got, expected, dtype)
    _, k, v = got.view(rows, 3, heads, head_dim).unbind(1)
    ref.store_kv_ref(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


@pytest.mark.parametrize("rows,slots", [(1, [5]), (1, [-1]), (3, [0, 9, -1])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_gemv_stores_k_and_v_in_the_cache(rows, slots, dtype):
    check_qkv_store(rows, slots, dtype)


def test_fusions_too_wide_for_the_kernel_are_computed_around_the_library_gemm():
    g = torch.Generator().manual_seed(3)
    make, w, b, act = _fused_case("layer+residual, gelu", 40, 8, 24, torch.float32, g)   # 40 rows > MAX_ROWS
    fused, unfused = make(), make()
    expected = skinny_gemm.activation_ref(ref.skinny_linear_ref(unfused.materialize(), w, b), "gelu", False)
    assert_close(skinny_linear(fused, w, b, **act), expected, torch.float32)
    assert torch.equal(fused.res_out, unfused.res_out)


def test_skinny_linear_keeps_leading_dims_and_hands_wide_inputs_to_the_library():
    x = torch.randn(2, 3, 40).to(DEVICE)                 # 6 rows in a 3-D batch
    w = torch.randn(24, 40).to(DEVICE)
    assert_close(skinny_linear(x, w), ref.skinny_linear_ref(x, w), torch.float32)
    wide = torch.randn(40, 40).to(DEVICE)               # 40 rows > MAX_ROWS: F.linear path
    assert_close(skinny_linear(wide, w), ref.skinny_linear_ref(wide, w), torch.float32)


@pytest.mark.parametrize("rows,n,k", [(2, 24, 64), (17, 40, 128), (64, 48, 256), (100, 33, 192), (5, 20, 40)])
@pytest.mark.parametrize("act,gated,with_bias", [(None, False, False), (None, False, True), ("gelu", False, True),
                                                 ("gelu_tanh", True, False), ("relu", False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_linear_matches_the_library_product_and_activation(rows, n, k, act, gated, with_bias, dtype):
    """The tile GEMM (batched decode rows, tuning.tile_gemm): rows over several row tiles, a
    ragged last feature tile, and the activation epilogue, against F.linear then the activation."""
    from enc2dec.kernels.tile_gemm import tile_linear

    g = torch.Generator().manual_seed(rows * 100 + n)
    width = 2 * n if gated else n
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(width, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, dtype) if with_bias else None
    got = tile_linear(x, w, b, act=act, gated=gated)
    assert got.shape == (rows, n) and got.dtype == dtype
    product = ref.skinny_linear_ref(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert_close(got, skinny_gemm.activation_ref(product, act, gated), dtype)


def test_tile_linear_hands_what_it_cannot_tile_to_the_library(monkeypatch):
    """One row (the GEMV's), more rows than a step (prompt or encoder work), K under a dot's 16:
    the reference product, never the kernel; a 3-D batch keeps its leading dims."""
    from enc2dec.kernels import tile_gemm

    launches = []
    kernel = tile_gemm._tile_gemm_kernel
    monkeypatch.setattr(tile_gemm, "_tile_gemm_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launches.append(grid), kernel[grid])[1]})())
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g).to(DEVICE)
    for x, weight in ((torch.randn(1, 64, generator=g), w), (torch.randn(300, 64, generator=g), w),
                      (torch.randn(8, 12, generator=g), torch.randn(16, 12, generator=g))):
        x, weight = x.to(DEVICE), weight.to(DEVICE)
        assert_close(tile_gemm.tile_linear(x, weight), ref.skinny_linear_ref(x, weight), torch.float32)
    assert launches == []
    batch = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    assert_close(tile_gemm.tile_linear(batch, w), ref.skinny_linear_ref(batch, w), torch.float32)
    assert len(launches) == 1


def test_use_skinny_linear_rebinds_plain_linears_only(monkeypatch):
    from torch import nn

    from enc2dec.engine.runner import fast_linear

    from enc2dec.engine.runner.fast_linear import use_skinny_linear
    from enc2dec.engine.models.layers import MergedLinear, RowParallelLinear

    class OtherLinear(nn.Linear):           # stands for a subclass whose forward does more than a matmul
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), MergedLinear(24, 8, 2, bias=True), RowParallelLinear(16, 12, True),
                          OtherLinear(12, 4)).to(DEVICE)
    few, many = torch.randn(1, 40).to(DEVICE), torch.randn(40, 40).to(DEVICE)
    expected = [model(few), model(many)]
    calls = []
    kernel = fast_linear.skinny_linear
    monkeypatch.setattr(fast_linear, "skinny_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    assert use_skinny_linear(model) == 3
    assert [type(m) for m in model] == [fast_linear.SkinnyLinear, fast_linear.SkinnyMergedLinear,
                                        fast_linear.SkinnyRowParallelLinear, OtherLinear]
    for x, e in zip((few, many), expected):
        assert_close(model(x), e, torch.float32)
    assert len(calls) == 3 and all(shape[0] == 1 for shape in calls)   # one-row calls only, three layers


def test_backend_encoder_masks_are_reused_per_microbatch_only():
    """Layers of one encoder forward share its masks; a new microbatch (a new meta) gets its own."""
    g = torch.Generator().manual_seed(7)
    backend, ref = TritonAttentionBackend(), TorchAttentionBackend()
    bias = torch.randn(2, 2 * 16 - 1, generator=g).to(DEVICE)
    for seq_lens in ([5, 9, 3], [4, 4], [2, 11]):
        meta = encoder_meta(seq_lens)
        for _layer in range(2):
            q, k, v = (torch.randn(sum(seq_lens), 2, 64, generator=g).to(DEVICE) for _ in range(3))
            assert_close(backend.encoder_attention(q, k, v, meta, 1.0, bias),
                         ref.encoder_attention(q, k, v, meta, 1.0, bias), torch.float32)


def test_fallback_without_triton_uses_reference(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    case = make_paged_case([20, 3], [1, 1], 2, 64, seed=1)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "kv_lens", "block_tables")]
    got = paged_attention(*args, 1.0, causal=True, bias_table=case["bias"])
    assert_close(got, ref.paged_attention_ref(*args, 1.0, causal=True, bias_table=case["bias"]), torch.float32)
    x = torch.randn(3, 32, device=DEVICE)
    assert_close(gated_gelu(x), ref.gated_gelu_ref(x), torch.float32)


def test_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import enc2dec.kernels as k, enc2dec.kernels.backend\n"
            "assert not k.triton_available() and k.TritonAttentionBackend.name == 'triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tile_gemm_takes_the_measured_configurations_file(tmp_path):
    """tuning.tile_gemm_configs (gemm_probe.py --save-configs): a shape it holds takes its
    measured tiling (the unsplit one under a LayerNorm prologue) and its measured verdict
    against cuBLAS; other shapes keep the built-in rule; a file it cannot read is an error."""
    import json

    from enc2dec.kernels import tile_gemm

    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"64,1024,2816": {"config": [64, 64, 128, 4, 3, 4], "unsplit": [64, 16, 256, 4, 4, 1],
                                                 "pays": True},
                                "64,5120,1280": {"config": [64, 64, 128, 4, 3, 1], "pays": False}}))
    tile_gemm.set_configs_file(str(path))
    try:
        assert tile_gemm.launch_config(48, 1024, 2816) == (64, 64, 128, 4, 3, 4)
        assert tile_gemm.launch_config(8, 1024, 2816, split_ok=False) == (16, 16, 256, 4, 4, 1)
        assert tile_gemm.launch_config(64, 1024, 1024) == tile_gemm.launch_config(64, 1000, 1024)[:1] + (32, 128, 4, 4, 1)
        assert tile_gemm.tile_pays(64, 1024, 2816, False)
        assert not tile_gemm.tile_pays(64, 5120, 1280, False) and tile_gemm.tile_pays(64, 5120, 1280, True)
        assert not tile_gemm.tile_pays(128, 1024, 2816, False)            # no 128-row entry: the rule's cuBLAS
        for i, bad in enumerate(['{"64,1024": {"config": [64, 64, 128, 4, 3, 4], "pays": true}}',     # no K
                                 '{"64,1024,1024": {"pays": true}}',                                 # no config
                                 '{"64,1024,1024": {"config": [64, 64, 128, 4, 3], "pays": true}}',  # no SPLIT_K
                                 '{"64,1024,1024": {"config": [64, 64, 128, 4, 3, 4]}}']):          # no verdict
            (tmp_path / f"bad{i}.json").write_text(bad)
            with pytest.raises(ValueError, match="tile_gemm_configs: cannot read tile configurations"):
                tile_gemm.set_configs_file(str(tmp_path / f"bad{i}.json"))
        with pytest.raises(ValueError, match="tile_gemm_configs"):
            tile_gemm.set_configs_file(str(tmp_path / "missing.json"))
        assert tile_gemm.launch_config(48, 1024, 2816) == (64, 64, 128, 4, 3, 4)     # the good file still in effect
    finally:
        tile_gemm.set_configs_file("")
    assert tile_gemm.launch_config(48, 1024, 2816)[5] == 1


def test_tile_gemm_finds_the_configurations_shipped_for_its_gpu(tmp_path, monkeypatch):
    """tuning.tile_gemm_configs "" takes the file shipped for the GPU's name (kernels/configs/),
    and the built-in rule on a GPU with none; "none" the rule even where one is shipped; a path
    is taken as given."""
    from enc2dec.kernels import tile_gemm

    for f in tile_gemm.CONFIGS_DIR.glob("*.json"):                             # what the package ships reads
        tile_gemm._read_configs(str(f))
    monkeypatch.setattr(tile_gemm, "CONFIGS_DIR", tmp_path)
    shipped = tmp_path / "tile_gemm_NVIDIA_H100_80GB_HBM3.json"
    shipped.write_text("{}")
    assert tile_gemm.configs_file_for("", "NVIDIA H100 80GB HBM3") == str(shipped)
    assert tile_gemm.configs_file_for("", "NVIDIA H200") == ""                 # nothing measured there
    assert tile_gemm.configs_file_for("", "") == ""                            # the CPU
    assert tile_gemm.configs_file_for("none", "NVIDIA H100 80GB HBM3") == ""
    assert tile_gemm.configs_file_for("/etc/h.json", "NVIDIA H100 80GB HBM3") == "/etc/h.json"
