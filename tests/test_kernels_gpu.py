"""The kernel comparisons of ``test_kernels.py`` on CUDA, compiled, at serving shapes, in
fp32 and bf16; the decoder path is also run under ``set_sync_debug_mode("error")`` to
prove it free of host syncs. Run on the GPU machine: ``pytest -m gpu``."""
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
if importlib.util.find_spec("triton") is None:  # find, not import: TRITON_INTERPRET is read at import
    pytest.skip("triton is not installed", allow_module_level=True)

from enc2dec.engine.models.attention import TorchAttentionBackend
from enc2dec.kernels import reference as ref
from enc2dec.kernels.activations import gated_gelu, gelu
from enc2dec.kernels.backend import TritonAttentionBackend
from enc2dec.kernels.kv_store import store_kv
from enc2dec.kernels.norms import fused_add_layer_norm, fused_add_rms_norm
from gpu_sync import queue_busy_work, syncs_raise
from test_kernels import (  # tests/ is on sys.path (pytest's default import mode)
    TOL,
    assert_close,
    check_backend_decode,
    check_fused,
    check_paged,
    check_qkv_store,
    check_store_in_attention,
    decoder_meta,
    encoder_meta,
    make_paged_case,
    poison_allocations,  # noqa: F401  (the autouse NaN-poisoning fixture)
)

DTYPES = [torch.float32, torch.bfloat16]


def lengths(n, low, high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,num_seqs,max_len,heads,head_dim,tpb,causal", [
    ("t5-large self, c=64", 64, 256, 16, 64, 16, True),
    ("whisper cross, c=32", 32, 1500, 20, 64, 16, False),
    ("whisper cross, c=2 (split-K)", 2, 1500, 20, 64, 64, False),
    ("hd128 self, 32 heads", 16, 512, 32, 128, 32, True),
])
@pytest.mark.parametrize("splits", [None, 4])
def test_paged_attention_cuda(dtype, name, num_seqs, max_len, heads, head_dim, tpb, causal, splits):
    kv_lens = [max_len] * num_seqs if not causal else lengths(num_seqs, 1, max_len, seed=num_seqs)
    q_lens = [1] * num_seqs
    if causal:                                                   # a few first steps / recomputes
        q_lens[0], q_lens[-1] = min(4, kv_lens[0]), kv_lens[-1]
    case = make_paged_case(kv_lens, q_lens, heads, head_dim, tokens_per_block=tpb, dtype=dtype,
                           device="cuda", seed=heads)
    check_paged(case, causal=causal, use_bias=causal, num_splits=splits, scale=1.0 if causal else 0.125,
                dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_last_split_merges_in_a_cuda_graph(dtype):
    """Split-K attention whose last split merges, captured once and replayed over new queries
    (its arrival counts made before the capture and back at zero after every replay): each
    replay equals the eager two-kernel result bit for bit."""
    from enc2dec.kernels.paged_attention import paged_attention

    case = make_paged_case([1500] * 48, [1] * 48, 20, 64, tokens_per_block=16, dtype=dtype, device="cuda", seed=5)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "kv_lens", "block_tables")]
    q = args[0]
    out = torch.empty_like(q)
    paged_attention(*args, 0.125, causal=False, num_splits=4, out=out)         # warm-up: compiles, sizes the counts
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, 0.125, causal=False, num_splits=4, out=out, last_split_merges=True)
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda())
        graph.replay()
        want = paged_attention(*args, 0.125, causal=False, num_splits=4, last_split_merges=False)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,fp8,head_major", [(None, False, False), (4, False, False), (16, False, True),
                                                   (4, True, False), (16, True, True)])
def test_paged_attention_stores_the_new_tokens_cuda(dtype, splits, fp8, head_major):
    """The new K/V stored by the attention kernel at a t5-large self-attention shape (c=64), where
    the programs of a launch race: each token's last key is read by the program that stored it."""
    for seed in range(3):
        check_store_in_attention(lengths(64, 1, 256, seed=seed), 16, splits, fp8, head_major, dtype=dtype,
                                 device="cuda", seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cuda(dtype):
    n, heads, head_dim, tpb, blocks = 4096, 16, 64, 16, 512
    kv = torch.randn(n, 2, heads, head_dim, device="cuda", dtype=dtype)
    slots = torch.randperm(blocks * tpb, device="cuda")[:n]
    slots[::7] = -1
    caches = [torch.full((blocks, tpb, heads, head_dim), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    store_kv(kv[:, 0], kv[:, 1], caches[0], caches[1], slots)
    ref.store_kv_ref(kv[:, 0], kv[:, 1], caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(512, 1024), (3, 4096), (2, 7, 1280)])
def test_norms_and_activations_cuda(dtype, shape):
    x, residual = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=dtype)
    bias = 0.1 * torch.randn(shape[-1], device="cuda", dtype=dtype)
    pairs = ((fused_add_rms_norm(x, residual, weight, 1e-6), ref.fused_add_rms_norm_ref(x, residual, weight, 1e-6)),
             (fused_add_layer_norm(x, residual, weight, bias, 1e-5),
              ref.fused_add_layer_norm_ref(x, residual, weight, bias, 1e-5)))
    for got, expected in pairs:
        assert_close(got[0], expected[0], dtype)
        assert_close(got[1], expected[1], dtype)
    for approximate in ("none", "tanh"):
        assert_close(gelu(x, approximate), ref.gelu_ref(x, approximate), dtype)
        assert_close(gated_gelu(x, approximate), ref.gated_gelu_ref(x, approximate), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,n,k", [
    ("rms+residual", 3072, 1024), ("rms+residual, gated gelu_tanh", 2816, 1024), ("plain", 1024, 2816),
    ("plain", 32128, 1024),                                                                  # flan-t5-large
    ("layer+residual", 3840, 1280), ("layer+residual, gelu", 5120, 1280), ("plain", 51866, 1280),   # whisper-large-v3
])
def test_skinny_gemv_and_its_fusions_cuda(dtype, name, n, k):
    """The one-row decode GEMV at serving shapes, with the norm (+ residual add) before it and
    the activation after it (T5: gated) that it fuses; the new residual rounded alike, bit for bit."""
    check_fused(name, 1, n, k, dtype, exact_residual=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,d", [(16, 64, 1024), (20, 64, 1280)])     # flan-t5-large, whisper-large-v3
def test_qkv_gemv_stores_k_and_v_cuda(dtype, heads, head_dim, d):
    check_qkv_store(1, [517], dtype, heads, head_dim, d, blocks=64, tpb=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_matches_torch_backend_without_host_syncs(dtype, monkeypatch):
    num_seqs = 24
    q_lens = [1] * (num_seqs - 2) + [3, 40]
    kv_lens = [max(q, n) for q, n in zip(q_lens, lengths(num_seqs, 1, 200, seed=1))]
    case = make_paged_case(kv_lens, q_lens, 8, 64, dtype=dtype, device="cuda", seed=3)
    enc_case = make_paged_case(lengths(num_seqs, 1, 1500, seed=2), q_lens, 8, 64, dtype=dtype, device="cuda", seed=4)
    # sdpa in bf16 rounds its probabilities to bf16; the kernel keeps them fp32.
    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    monkeypatch.setitem(TOL, dtype, tol)
    check_backend_decode(case, enc_case, q_lens, kv_lens, dtype)

    meta_enc = encoder_meta([37, 128, 5], device="cuda")
    q, k, v = (torch.randn(170, 8, 64, device="cuda", dtype=dtype) for _ in range(3))
    bias = torch.randn(8, 2 * 128 - 1, device="cuda")
    expected = TorchAttentionBackend().encoder_attention(q, k, v, meta_enc, 1.0, bias)
    backend = TritonAttentionBackend()
    meta = decoder_meta(case, q_lens, kv_lens, enc_case)
    torch.cuda.synchronize()
    with syncs_raise():
        got = backend.encoder_attention(q, k, v, meta_enc, 1.0, bias)
        backend.self_attention(case["q"], case["k_cache"], case["v_cache"], meta, 1.0, case["bias"])
        backend.cross_attention(case["q"], enc_case["k_cache"], enc_case["v_cache"], meta, 0.125)
    assert_close(got, expected, dtype)


def test_programmatic_launch_gives_the_same_results_eagerly_and_in_a_cuda_graph():
    """A decoder layer's chain of kernels (add+norm, cuBLAS, gated GELU, the one-row GEMV with
    its norm, the tile GEMM with its activation, attention storing the new K/V) launched with
    programmatic dependent launch, each
    kernel waiting on the GPU for the one before it: eagerly and captured in a CUDA graph and
    replayed over new inputs, bit for bit what the ordinary launches give."""
    import torch.nn.functional as F

    from enc2dec.kernels import set_programmatic_launch
    from enc2dec.kernels.paged_attention import paged_attention
    from enc2dec.kernels.skinny_gemm import Prologue, skinny_linear
    from enc2dec.kernels.tile_gemm import tile_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x, res = (torch.randn(64, 1024, device="cuda", generator=g).to(bf) for _ in range(2))
    gain, w_up, w_one = torch.randn(1024, device="cuda", dtype=bf), \
        torch.randn(2 * 2816, 1024, device="cuda", generator=g).to(bf) * 0.03, \
        torch.randn(3 * 1024, 1024, device="cuda", generator=g).to(bf) * 0.03
    case = make_paged_case(lengths(64, 1, 256, seed=0), [1] * 64, 16, 64, dtype=bf, device="cuda", seed=1)
    tpb = case["k_cache"].shape[1]
    slots = torch.tensor([int(case["block_tables"][i, (n - 1) // tpb]) * tpb + (n - 1) % tpb
                          for i, n in enumerate(case["kv_lens"].tolist())], device="cuda")

    def chain(k_cache, v_cache):
        h, new_res = fused_add_rms_norm(x, res, gain, 1e-6)
        act = gated_gelu(F.linear(h, w_up))                                        # [64, 2816]
        one = skinny_linear(Prologue(act[:1, :1024], residual=new_res[:1], norm_weight=gain), w_one)
        tiled = tile_linear(h, w_up, act="gelu_tanh", gated=True)                  # its weights prefetched
        qkv = (tile_linear(tiled[:, :1024], w_one) + one).view(64, 3, 16, 64)
        o = paged_attention(qkv[:, 0], k_cache, v_cache, case["query_start_loc"], case["kv_lens"],
                            case["block_tables"], 1.0, causal=True, bias_table=case["bias"], num_splits=4,
                            new_kv=(qkv[:, 1], qkv[:, 2], slots))
        return [new_res, act, one, tiled, o, k_cache, v_cache]

    def run(pdl: bool, graph: bool):
        set_programmatic_launch(pdl)
        try:
            pools = [case["k_cache"].clone(), case["v_cache"].clone()]
            if not graph:
                return chain(*pools)
            chain(*[p.clone() for p in pools])                                     # compile outside the capture
            torch.cuda.synchronize()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                outs = chain(*pools)
            results = []
            for seed in range(2):          # new inputs replayed through the captured launches
                x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
                cuda_graph.replay()
                results.append([t.clone() for t in outs])
            return results
        finally:
            set_programmatic_launch(False)

    x0 = x.clone()
    want, got = run(False, False), run(True, False)
    for a, b in zip(got, want):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)
    graphs = {}
    for pdl in (False, True):
        x.copy_(x0)
        graphs[pdl] = run(pdl, True)
    for replay_pdl, replay_plain in zip(graphs[True], graphs[False]):
        for a, b in zip(replay_pdl, replay_plain):
            assert torch.equal(a, b)


def test_smoke_one_decode_step():
    case = make_paged_case([5], [1], 4, 64, device="cuda", dtype=torch.bfloat16)
    meta = decoder_meta(case, [1], [5])
    backend = TritonAttentionBackend()
    out = backend.self_attention(case["q"], case["k_cache"], case["v_cache"], meta, 1.0, case["bias"])
    out = out + backend.cross_attention(case["q"], case["k_cache"], case["v_cache"], meta, 0.125)
    torch.cuda.synchronize()
    assert out.shape == case["q"].shape and torch.isfinite(out).all()


def _race_case(rows, vocab, seed):
    """Logits at serving scale with a top-k-like share of -inf, and one key per row."""
    from enc2dec.engine.runner.sampling_ops import stream_key

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(rows, vocab, device="cuda", generator=g) * 3                # [R, V]
    cut = scores.topk(50, dim=-1).values[:, -1:]
    scores[rows // 2:] = scores[rows // 2:].masked_fill(scores[rows // 2:] < cut[rows // 2:], float("-inf"))
    keys = torch.tensor([[*stream_key(seed + r, 0), 7 * r] for r in range(rows)], device="cuda")   # [R, 3]
    return scores, keys


@pytest.mark.parametrize("rows,vocab", [(64, 32128), (3, 51865), (256, 50265)])
def test_gumbel_race_cuda_matches_reference(rows, vocab):
    from enc2dec.kernels.sampling import gumbel_race

    for seed in range(3):
        scores, keys = _race_case(rows, vocab, seed)
        want = ref.gumbel_race_ref(scores, keys)
        assert torch.equal(gumbel_race(scores, keys), want)
        assert torch.equal(gumbel_race(scores, keys[:rows // 3], keys[rows // 3:]), want)   # seeded + fresh rows


def test_race_cuda_does_not_sync_and_keeps_seeded_rows_apart():
    from enc2dec.engine.runner.sampling_ops import race

    scores, keys = _race_case(64, 32128, seed=5)
    alone = race(scores[:8], keys[:8], 8)
    torch.cuda.synchronize()
    with syncs_raise():
        queue_busy_work(10)
        mixed = race(scores, keys[:8], 8)               # 8 seeded rows, 56 drawing their keys
        unseeded = race(scores, keys[:0], 0)
    assert torch.equal(mixed[:8], alone)
    assert unseeded.shape == (64,) and bool(((unseeded >= 0) & (unseeded < 32128)).all())


def test_gumbel_race_cuda_follows_the_softmax():
    from enc2dec.kernels.sampling import gumbel_race

    draws, logits = 200_000, torch.tensor([2.0, 1.7, 1.3, 1.1, 0.8, 0.5, float("-inf"), -0.1, -0.5, -1.0],
                                          device="cuda")
    keys = torch.randint(0, 1 << 32, (draws, 3), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    counts = torch.bincount(gumbel_race(logits.expand(draws, -1), keys), minlength=10).double()
    want = logits.softmax(dim=-1).double() * draws
    kept = want > 0
    assert counts[~kept].sum() == 0
    chi2 = float(((counts[kept] - want[kept]) ** 2 / want[kept]).sum())
    assert chi2 < 27.877, f"chi2={chi2:.1f}: {counts.tolist()} vs {want.round().tolist()}"   # p = 0.001, 9 dof


def _filtered_case(rows, vocab, seed):
    # bf16-rounded logits (ties), per-row top-k / top-p / min-p as the sampler stages them
    scores, keys = _race_case(rows, vocab, seed)
    scores = scores.bfloat16().float() / 0.8
    g = torch.Generator(device="cuda").manual_seed(seed)
    top_k = torch.where(torch.rand(rows, device="cuda", generator=g) < 0.3,
                        torch.randint(1, 100, (rows,), device="cuda", generator=g), 0)
    top_p = torch.where(torch.rand(rows, device="cuda", generator=g) < 0.7,
                        torch.rand(rows, device="cuda", generator=g) * 0.99 + 0.01, 1.0)
    min_p = torch.where(torch.rand(rows, device="cuda", generator=g) < 0.2, 0.05, 0.0)
    return scores, ref.top_k_floor_ref(scores, top_k, 100), top_p, min_p, keys


@pytest.mark.parametrize("rows,vocab", [(64, 32128), (256, 51866)])
def test_filtered_race_cuda_matches_reference(rows, vocab):
    from enc2dec.kernels.sampling import filtered_race

    mismatched = 0
    for seed in range(3):
        scores, floor, top_p, min_p, keys = _filtered_case(rows, vocab, seed)
        want = ref.filtered_race_ref(scores, floor, top_p, min_p, keys)
        got = filtered_race(scores, floor, top_p, min_p, keys[:rows // 3], keys[rows // 3:])
        # exp on the GPU may round an ulp from torch's: a row can differ only where its
        # winner sits on a filter's boundary, which is rare at these sizes
        mismatched += int((got != want).sum())
    assert mismatched <= 3 * rows // 100, f"{mismatched} of {3 * rows} rows differ from the reference"


@pytest.mark.parametrize("rows,vocab", [(64, 32128), (256, 51866)])
@pytest.mark.parametrize("splits", [None, 2, 8])
def test_split_filtered_race_cuda_equals_the_per_row_kernel(rows, vocab, splits):
    # The split race merges per-chunk partials; its tokens must be the per-row kernel's
    # (the same race values and tie rule; only masses summed in another order) and the
    # reference's up to exp's last-ulp differences on a filter boundary.
    from enc2dec.kernels.sampling import filtered_race

    mismatched = 0
    for seed in range(3):
        scores, floor, top_p, min_p, keys = _filtered_case(rows, vocab, seed)
        per_row = filtered_race(scores, floor, top_p, min_p, keys[:rows // 3], keys[rows // 3:], splits=1)
        got = filtered_race(scores, floor, top_p, min_p, keys[:rows // 3], keys[rows // 3:], splits=splits)
        assert torch.equal(got, per_row)
        mismatched += int((got != ref.filtered_race_ref(scores, floor, top_p, min_p, keys)).sum())
    assert mismatched <= 3 * rows // 100, f"{mismatched} of {3 * rows} rows differ from the reference"


@pytest.mark.parametrize("rows,vocab", [(64, 32128), (256, 51866)])
def test_split_filtered_race_cuda_runs_in_a_graph_without_syncs(rows, vocab):
    from enc2dec.kernels.sampling import filtered_race

    scores, floor, top_p, min_p, keys = _filtered_case(rows, vocab, seed=4)
    want = filtered_race(scores, floor, top_p, min_p, keys, splits=1)
    torch.cuda.synchronize()
    with syncs_raise():
        queue_busy_work(10)
        eager = filtered_race(scores, floor, top_p, min_p, keys, splits=4)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        filtered_race(scores, floor, top_p, min_p, keys, splits=4)        # warm-up: compile outside capture
        with torch.cuda.graph(graph, stream=stream):
            captured = filtered_race(scores, floor, top_p, min_p, keys, splits=4)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(eager, want)
    keys.copy_(keys.flip(0))                                               # new inputs, same graph
    graph.replay()
    assert torch.equal(captured, filtered_race(scores, floor, top_p, min_p, keys, splits=1))


def test_sampled_step_cuda_does_not_sync():
    from enc2dec.engine.runner.sampling_ops import race

    scores, keys = _race_case(64, 32128, seed=7)
    filters = (torch.full((64,), 40, device="cuda"), torch.full((64,), 0.95, device="cuda"),
               torch.full((64,), 0.02, device="cuda"), 40)
    alone = race(scores[:8], keys[:8], 8, tuple(t[:8] if torch.is_tensor(t) else t for t in filters))
    torch.cuda.synchronize()
    with syncs_raise():
        queue_busy_work(10)
        mixed = race(scores, keys[:8], 8, filters)
    assert torch.equal(mixed[:8], alone)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_pool_store_and_attention_cuda(causal):
    # Whisper-large-v3 cross attention at C=64 (1500 keys, 20 heads x 64) and T5 self attention.
    from enc2dec.kernels.kv_store import store_kv
    from enc2dec.kernels.paged_attention import paged_attention

    kv_lens, q_lens, heads = ([1500] * 64, [1] * 64, 20) if not causal else ([130, 7, 255, 64] * 4, [1] * 16, 16)
    case = make_paged_case(kv_lens, q_lens, heads, 64, tokens_per_block=32, dtype=torch.bfloat16, seed=11)
    k8 = torch.zeros_like(case["k_cache"], dtype=torch.float8_e4m3fn)
    v8 = torch.zeros_like(k8)
    scales = [torch.zeros(k8.shape[:3], dtype=ref.FP8_SCALE_DTYPE, device="cuda") for _ in range(2)]
    slots = torch.arange(k8.shape[0] * k8.shape[1], device="cuda")
    flat = lambda c: c.view(-1, heads, 64)                                        # noqa: E731
    store_kv(flat(case["k_cache"]), flat(case["v_cache"]), k8, v8, slots, kv_scales=tuple(scales))
    want8 = [torch.zeros_like(k8), torch.zeros_like(v8)]
    want_scales = [torch.zeros_like(s) for s in scales]
    ref.store_kv_ref(flat(case["k_cache"]), flat(case["v_cache"]), *want8, slots, kv_scales=tuple(want_scales))
    assert all(torch.equal(a, b) for a, b in zip(scales, want_scales))
    assert int((k8.view(torch.uint8).int() - want8[0].view(torch.uint8).int()).abs().max()) <= 1
    args = (case["q"], k8, v8, case["query_start_loc"], case["kv_lens"], case["block_tables"])
    bias = case["bias"] if causal else None
    got = paged_attention(*args, 0.125, causal=causal, bias_table=bias, kv_scales=tuple(scales))
    want = ref.paged_attention_ref(*args, 0.125, causal=causal, bias_table=bias, kv_scales=tuple(scales))
    assert_close(got, want, torch.bfloat16)
    exact = ref.paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], *args[3:], 0.125, causal=causal,
                                    bias_table=bias)
    assert float((got.float() - exact.float()).abs().max()) < 0.1 * float(exact.float().abs().max())
    with syncs_raise():
        queue_busy_work(5)
        store_kv(flat(case["k_cache"]), flat(case["v_cache"]), k8, v8, slots, kv_scales=tuple(scales))
        paged_attention(*args, 0.125, causal=causal, bias_table=bias, kv_scales=tuple(scales))


@pytest.mark.parametrize("fp8", [False, True])
def test_head_major_pool_past_2_31_elements_cuda(fp8):
    # A head-major pool's head stride is a whole layer's pool. whisper-large-v3-turbo's 4 layers
    # share the cross budget, so one layer's pool is this large and the last head's offset
    # (head x head stride) passes 2**31 elements (32-bit offsets wrapped: an illegal address).
    from enc2dec.kernels.paged_attention import paged_attention

    heads, head_dim, tpb = 20, 64, 16
    num_blocks = 2 ** 31 // ((heads - 1) * tpb * head_dim) + 2       # (heads - 1) x stride > 2**31
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    pools = [torch.zeros((heads, num_blocks, tpb, head_dim), dtype=dtype, device="cuda").permute(1, 2, 0, 3)
             for _ in range(2)]
    scales = tuple(torch.zeros((heads, num_blocks, tpb), dtype=ref.FP8_SCALE_DTYPE, device="cuda").permute(1, 2, 0)
                   for _ in range(2)) if fp8 else None
    n = 2 * tpb                                                    # one request in the pool's last two blocks
    kv = torch.randn(n, 2, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    store_kv(kv[:, 0], kv[:, 1], *pools, torch.arange((num_blocks - 2) * tpb, num_blocks * tpb, device="cuda"),
             kv_scales=scales)
    # what a small token-major pool holds after the reference store of the same rows
    small = [torch.zeros((2, tpb, heads, head_dim), dtype=dtype, device="cuda") for _ in range(2)]
    small_scales = tuple(torch.zeros((2, tpb, heads), dtype=ref.FP8_SCALE_DTYPE, device="cuda")
                         for _ in range(2)) if fp8 else None
    ref.store_kv_ref(kv[:, 0], kv[:, 1], *small, torch.arange(n, device="cuda"), kv_scales=small_scales)
    for big, want in zip(pools, small):
        got = big[-2:].contiguous()
        if fp8:
            assert int((got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs().max()) <= 1
        else:
            assert torch.equal(got, want)
    if fp8:
        assert all(torch.equal(s[-2:].contiguous(), w) for s, w in zip(scales, small_scales))
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    tables = torch.tensor([[num_blocks - 2, num_blocks - 1]], dtype=torch.int32, device="cuda")
    got = paged_attention(q, *pools, qsl, lens, tables, 0.125, causal=False, kv_scales=scales)
    small = [big[-2:].contiguous() for big in pools]               # the big pool's own rows, token-major
    small_scales = tuple(s[-2:].contiguous() for s in scales) if fp8 else None
    want = ref.paged_attention_ref(q, *small, qsl, lens, torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
                                   0.125, causal=False, kv_scales=small_scales)
    assert_close(got, want, torch.bfloat16)


@pytest.mark.parametrize("rows", [2, 64, 256])
def test_tile_linear_matches_cublas_at_decode_shapes(rows):
    """The tile GEMM against cuBLAS on flan-t5-large's and whisper-large-v3's decode products
    (bf16; a gated GELU and a biased GELU epilogue), eagerly and programmatically launched."""
    import torch.nn.functional as F

    from enc2dec.kernels import set_programmatic_launch
    from enc2dec.kernels.skinny_gemm import activation_ref
    from enc2dec.kernels.tile_gemm import tile_linear

    g = torch.Generator(device="cuda").manual_seed(rows)
    bf = torch.bfloat16
    shapes = [(3072, 1024, None, False, False), (2 * 2816, 1024, "gelu_tanh", True, False),
              (1024, 2816, None, False, False), (5120, 1280, "gelu", False, True), (51866, 1280, None, False, False)]
    for n, k, act, gated, with_bias in shapes:
        x = torch.randn(rows, k, device="cuda", generator=g).to(bf)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(bf)
        b = torch.randn(n, device="cuda", generator=g).to(bf) if with_bias else None
        want = activation_ref(F.linear(x, w, b), act, gated).float()
        for pdl in (False, True):
            set_programmatic_launch(pdl)
            try:
                got = tile_linear(x, w, b, act=act, gated=gated).float()
            finally:
                set_programmatic_launch(False)
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    # a T5 pre-norm (+ residual) and a Whisper one (LayerNorm, bias) riding in the product
    from enc2dec.kernels.skinny_gemm import Prologue

    for norm, k in (("rms", 1024), ("layer", 1280)):
        x, res = (torch.randn(rows, k, device="cuda", generator=g).to(bf) for _ in range(2))
        gain, shift = (torch.randn(k, device="cuda", generator=g).to(bf) for _ in range(2))
        w = (torch.randn(3 * k, k, device="cuda", generator=g) * k ** -0.5).to(bf)

        def prologue():
            return Prologue(x, res, norm=norm, norm_weight=gain, norm_bias=shift if norm == "layer" else None)

        fused, plain = prologue(), prologue()
        want = F.linear(plain.materialize(), w).float()
        set_programmatic_launch(True)
        try:
            got = tile_linear(fused, w).float()
        finally:
            set_programmatic_launch(False)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
        assert torch.equal(fused.res_out, plain.res_out)
