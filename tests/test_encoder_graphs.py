"""Encoder CUDA graphs' CPU-checkable half: the bucket grid, the bucket choice, and the padded
layout they replay, run eagerly here (``replay=False``): it must write the same cross-attention
K/V as the ordinary packed encoder step, for every family and both attention backends (the
triton backend's encoder path is torch SDPA plus the Triton K/V store, interpreted here)."""
import numpy as np
import pytest
import torch

from enc2dec.engine import LLM, KvCacheConfig
from enc2dec.engine.core.batch import ScheduledEncode
from enc2dec.engine.core.block_manager import slot_ids
from enc2dec.engine.config import EncodeCudaGraphConfig
from enc2dec.engine.runner.cuda_graph import EncoderGraphRunner, encoder_buckets


def test_default_buckets_are_powers_of_two_up_to_the_limits():
    got = encoder_buckets(EncodeCudaGraphConfig(), max_batch=8, max_tokens=1024, max_len=300)
    assert got == [(1, 64), (1, 128), (1, 256), (1, 300), (2, 64), (2, 128), (2, 256), (2, 300),
                   (3, 64), (3, 128), (3, 256), (3, 300),      # the 3 longest inputs 1024 tokens admit
                   (4, 64), (4, 128), (4, 256), (8, 64), (8, 128)]


def test_a_wave_of_short_requests_that_fills_the_token_cap_has_a_graph():
    # flan-t5 at C=64 and C=256: 64 requests of 128 tokens fill a step's 8192 tokens
    got = encoder_buckets(EncodeCudaGraphConfig(), max_batch=256, max_tokens=8192, max_len=1024)
    assert (64, 128) in got and (128, 64) in got and (8, 1024) in got
    assert all(b * n <= 8192 for b, n in got) and max(b for b, _ in got) == 128


def test_configured_buckets_and_the_token_cap():
    cfg = EncodeCudaGraphConfig(batch_sizes=(1, 3, 16), seq_lens=(100, 200, 5000), num_tokens=(400,))
    assert encoder_buckets(cfg, max_batch=8, max_tokens=8192, max_len=1024) == [(1, 100), (1, 200), (3, 100)]
    assert encoder_buckets(EncodeCudaGraphConfig(), 4, 8192, 1500, fixed_len=1500) == [(1, 1500), (2, 1500),
                                                                                        (4, 1500)]
    # Whisper's default: 8192 tokens admit 5 clips a step, and 5 gets its own graph
    assert encoder_buckets(EncodeCudaGraphConfig(), 64, 8192, 1500, fixed_len=1500) == [
        (1, 1500), (2, 1500), (4, 1500), (5, 1500)]


def _enc(lens):
    return [ScheduledEncode(request_id=str(i), encoder_input=[1] * n, encoder_len=n, cross_block_ids=[0] * 99)
            for i, n in enumerate(lens)]


def test_pick_takes_the_cheapest_bucket_that_holds_the_batch():
    runner = EncoderGraphRunner(None, None, torch.device("cpu"), [(1, 64), (2, 64), (4, 64), (1, 128), (2, 128)],
                                tokens_per_block=16, pad_batch=True, dtype=torch.float32)
    assert runner.pick(_enc([10, 60])) == (2, 64)
    assert runner.pick(_enc([10, 100])) == (2, 128)
    assert runner.pick(_enc([10, 20, 30])) == (4, 64)
    assert runner.pick(_enc([200])) is None                   # longer than every bucket: eager
    assert runner.pick(_enc([5] * 5)) is None                 # more requests than any bucket
    runner.pad_batch = False                                  # enable_padding=False: exact batch sizes
    assert runner.pick(_enc([10, 20, 30])) is None
    assert runner.pick(_enc([10, 20, 30, 40])) == (4, 64)


def _cross_kv_at(kv, encode, tpb):
    slots = torch.tensor(slot_ids(encode.cross_block_ids, 0, encode.encoder_len, tpb))
    return [torch.cat([layer.k.flatten(0, 1)[slots], layer.v.flatten(0, 1)[slots]]) for layer in kv.cross_kv]


def _packed_and_padded(runner):
    """Requests for one packed step into some cross blocks and one padded-layout step into
    others, same inputs; returns (packed, padded, bucket)."""
    model, tpb = runner.model, runner.tokens_per_block
    gen = np.random.RandomState(0)
    if runner.is_whisper:
        n = model.max_encoder_positions
        lens, bucket = [n, n], (4, n)
        inputs = [torch.from_numpy(gen.randn(model.config.num_mel_bins, 2 * n).astype(np.float32)) for _ in lens]
    else:
        lens, bucket = [5, 17, 9], (4, 32)
        inputs = [gen.randint(3, model.config.vocab_size, size=k).tolist() for k in lens]
    need = [-(-k // tpb) for k in lens]
    assert 2 * sum(need) <= runner.kv_plan.num_cross_blocks
    first, start = [], 0
    for k in need:
        first.append(list(range(start, start + k)))
        start += k
    second = [[b + start for b in blocks] for blocks in first]
    packed = [ScheduledEncode(str(i), x, k, blocks) for i, (x, k, blocks) in enumerate(zip(inputs, lens, first))]
    padded = [ScheduledEncode(str(i), x, k, blocks) for i, (x, k, blocks) in enumerate(zip(inputs, lens, second))]
    return packed, padded, bucket


def _assert_same_cross_kv(runner, packed, padded, **tol):
    for a, b in zip(packed, padded):
        for want, got in zip(_cross_kv_at(runner.kv, a, runner.tokens_per_block),
                             _cross_kv_at(runner.kv, b, runner.tokens_per_block)):
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "whisper"])
def test_padded_layout_writes_the_cross_kv_of_the_packed_step(family, backend, request):
    path = request.getfixturevalue(family)
    with LLM(path, dtype="float32", device="cpu", attn_backend=backend, max_batch_size=4,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        runner = llm.engine.runner
        packed, padded, bucket = _packed_and_padded(runner)
        with torch.no_grad():
            runner._run_encoder(packed)
            graphs = EncoderGraphRunner(runner.model, runner.kv, runner.device, [bucket], runner.tokens_per_block,
                                        pad_batch=True, dtype=runner.dtype,
                                        whisper_mels=runner.model.config.num_mel_bins if runner.is_whisper else None)
            features = runner._whisper_features(padded) if runner.is_whisper else None
            graphs.run(padded, bucket, features, replay=False)
            graphs.run(padded[:1], bucket, None if features is None else features[:1], replay=False)   # reuse
        _assert_same_cross_kv(runner, packed, padded, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["flan_t5", "bart", "whisper"])
def test_encoder_graph_replay_writes_the_cross_kv_of_the_eager_step(family, request):
    """On the GPU in bf16: the captured graphs, replayed (twice, the second time for a smaller
    batch), write what the eager packed step writes, up to bf16 rounding of other GEMM shapes."""
    path = request.getfixturevalue(family)
    with LLM(path, dtype="bfloat16", max_batch_size=4,
             encoder_cuda_graph_config=EncodeCudaGraphConfig(enable_padding=True),    # 3 requests -> bucket 4
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)) as llm:
        runner = llm.engine.runner
        graphs = runner.encoder_graphs
        assert graphs is not None and graphs.graphs
        packed, padded, bucket = _packed_and_padded(runner)
        assert graphs.pick(padded) is not None
        with torch.no_grad():
            runner.encoder_graphs = None
            runner._run_encoder(packed)                      # eager
            runner.encoder_graphs = graphs
            runner._run_encoder(padded[:1])                  # replays, then the full batch over it
            runner._run_encoder(padded)
        torch.cuda.synchronize()
        _assert_same_cross_kv(runner, packed, padded, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_admission_sizes_encoder_microbatches_to_the_captured_graphs(bart):
    """A step's token budget (256) admits 8 requests of ~20 positions, which no graph holds (the
    largest at 64 positions is 4 x 64): with ``encoder_batches_fit_graphs`` every encode replays a
    graph, 4 at a time; without it the first wave encodes eagerly."""
    from enc2dec.engine import SamplingParams, TuningConfig

    prompts = [f"summarize: item {i} of the list is here today" for i in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def encodes(fit: bool) -> tuple[list[int], list[int]]:
        with LLM(bart, dtype="bfloat16", max_batch_size=8, max_num_tokens=256, max_input_len=64,
                 tuning=TuningConfig(encoder_batches_fit_graphs=fit),
                 kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)) as llm:
            runner = llm.engine.runner
            assert runner.encoder_graphs.buckets[-1] == (4, 64)
            run_encoder, replayed, eager = runner._run_encoder, [], []

            def counting(batch):
                (replayed if runner.encoder_graphs.pick(batch) is not None else eager).append(len(batch))
                return run_encoder(batch)
            runner._run_encoder = counting
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
            return replayed, eager

    replayed, eager = encodes(fit=True)
    assert eager == [] and max(replayed) == 4 and sum(replayed) == len(prompts)
    replayed, eager = encodes(fit=False)
    assert eager and max(eager) > 4
