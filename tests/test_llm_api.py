"""The LLM API as a user sees it: sampling, streaming, preemption, stop rules and bad input."""
import asyncio
import json
import os
import shutil

import numpy as np
import pytest

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams

KV = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_cpu_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def t5_llm(t5_relu):
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=64, kv_cache_config=KV) as llm:
        yield llm


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(t5_llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=7, n=3, ignore_eos=True)
    a = t5_llm.generate("sample something", params)
    b = t5_llm.generate("sample something", params)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    c = t5_llm.generate("sample something", SamplingParams(max_tokens=10, temperature=1.0, seed=8, n=3,
                                                           ignore_eos=True))
    assert [o.token_ids for o in c.outputs] != [o.token_ids for o in a.outputs]


def test_seeded_sample_does_not_depend_on_batch_neighbours(t5_llm):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=123, ignore_eos=True)
    alone = t5_llm.generate("the same prompt", params).outputs[0].token_ids
    batch = t5_llm.generate(["other one", "the same prompt", "another prompt here"],
                            [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=9)],
                            use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_and_cumulative_logprob(t5_llm):
    out = t5_llm.generate("logprobs please", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                                            ignore_eos=True)).outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok]     # greedy picks the most likely token
        assert len(lp) == 3 and all(v <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-4)


def test_stop_token_ids_min_tokens_and_ignore_eos(t5_llm):
    free = t5_llm.generate("stop rules", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ids = free.outputs[0].token_ids
    assert len(ids) == 12 and free.outputs[0].finish_reason == "length"
    stop_at = ids[4]
    first = ids.index(stop_at)
    out = t5_llm.generate("stop rules", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop_at])).outputs[0]
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens holds back stop tokens: the token stop_at cannot end the sequence before 8 tokens.
    later = t5_llm.generate("stop rules", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         stop_token_ids=[stop_at], min_tokens=8)).outputs[0]
    assert len(later.token_ids) >= 8


def test_stop_string_truncates_text(byt5):
    with LLM(byt5, dtype="float32", max_batch_size=4, kv_cache_config=KV) as llm:
        free = llm.generate("byte level", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        text = free.outputs[0].text
        assert len(text) >= 6
        stop = text[3:5]
        out = llm.generate("byte level", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                        stop=[stop])).outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_streaming_yields_incremental_text_and_async_result(byt5):
    async def run(llm):
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        pieces, last = [], None
        async for out in llm.generate_async("stream me", params, streaming=True):
            pieces.append(out.outputs[0].text)
            last = out
        final = await llm.generate_async("stream me", params).aresult()
        return pieces, last, final

    with LLM(byt5, dtype="float32", max_batch_size=4, kv_cache_config=KV) as llm:
        pieces, last, final = asyncio.run(run(llm))
        blocking = llm.generate_async("stream me", SamplingParams(max_tokens=16, temperature=0.0,
                                                                   ignore_eos=True)).result(timeout=60)
    assert len(pieces) > 3 and last.finished
    assert all(b.startswith(a) for a, b in zip(pieces, pieces[1:]))     # text only grows
    assert pieces[-1] == final.outputs[0].text == blocking.outputs[0].text
    assert final.outputs[0].token_ids == blocking.outputs[0].token_ids


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_stream_never_shows_text_that_a_stop_string_then_cuts(byt5, engine_process):
    """Characters that may begin a stop string are held back until it is known whether they do:
    a client that concatenates the streamed pieces (as an SSE client does) gets the final text."""
    free_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(byt5, dtype="float32", max_batch_size=4, kv_cache_config=KV, engine_process=engine_process) as llm:
        free = llm.generate("byte level", free_params).outputs[0].text
        assert len(free) >= 8
        checked = 0
        for k in range(1, len(free) - 3):
            stop = free[k:k + 3]
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
            texts = [o.outputs[0].text for o in llm.generate_async("byte level", params, streaming=True)]
            final = texts[-1]
            assert final == free[:free.index(stop)]
            assert all(final.startswith(t) for t in texts), (stop, texts)
            checked += len(texts) > 2
    assert checked          # streams of several steps were looked at


def test_preemption_loses_no_request_and_no_token(t5_relu):
    prompts = [f"request number {i} " + "x " * (i % 5) for i in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=32, kv_cache_config=KV) as llm:
        roomy = llm.generate(prompts, params, use_tqdm=False)
    # A self pool far smaller than 8 running sequences need: the scheduler must preempt and resume.
    tiny = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_tokens=160)
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=32, kv_cache_config=tiny) as llm:
        tight = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.self_pool.num_used_blocks == 0
        assert llm.engine.scheduler.cross_pool.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_kv_pools_return_to_empty(t5_llm):
    t5_llm.generate(["a", "b c d", "e f g h i j"], SamplingParams(max_tokens=7, n=2, temperature=0.5),
                    use_tqdm=False)
    sched = t5_llm.engine.scheduler
    assert sched.self_pool.num_used_blocks == 0 and sched.cross_pool.num_used_blocks == 0


# ---- bad input: each names the problem, and the engine keeps serving ----------------------

@pytest.mark.parametrize("prompt, params, pattern", [
    ("x " * 200, None, "more than max_input_len=64"),
    ([5, 10 ** 6], None, r"outside the vocabulary"),
    ([], None, "empty"),
    ("beam", SamplingParams(use_beam_search=True, best_of=2), "max_beam_width"),
    (3.5, None, "unsupported prompt type"),
    ([5, 2.0, 7], None, "must be integers, got 2.0"),
    ([5, True, 7], None, "must be integers, got True"),
])
def test_bad_request_is_rejected_and_a_good_one_alongside_completes(t5_llm, prompt, params, pattern):
    good = t5_llm.generate_async("a good request", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    with pytest.raises(ValueError, match=pattern):
        t5_llm.generate(prompt, params)
    out = good.result(timeout=60)
    assert out.finished and len(out.outputs[0].token_ids) == 6 and out.error is None


def test_numpy_token_ids_decode_like_plain_ints(t5_llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ids = [5, 9, 17, 30]
    plain = t5_llm.generate(ids, params)
    as_numpy = t5_llm.generate([list(np.array(ids, dtype=np.int64))], params)[0]
    assert as_numpy.prompt_token_ids == ids and type(as_numpy.prompt_token_ids[0]) is int
    assert as_numpy.outputs[0].token_ids == plain.outputs[0].token_ids


def test_empty_batch(t5_llm):
    with pytest.raises(ValueError, match="empty batch"):
        t5_llm.generate([])


def test_missing_cross_kv_fraction(t5_relu):
    with pytest.raises(ValueError, match="cross_kv_cache_fraction is required"):
        LLM(t5_relu, kv_cache_config=KvCacheConfig())


@pytest.mark.parametrize("kwargs, pattern", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
    ({"context_parallel_size": 2}, "context_parallel_size must be 1"),
    ({"enable_attention_dp": True}, "enable_attention_dp must be False"),
    ({"max_batch_sizes": 3}, "unknown config key 'max_batch_sizes'"),
])
def test_rejected_engine_options(t5_relu, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LLM(t5_relu, kv_cache_config=KV, **kwargs)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    gen = os.path.join(dst, "generation_config.json")
    if os.path.exists(gen):
        g = json.load(open(gen))
        g.update({k: v for k, v in changes.items() if k in g or v is None})
        json.dump(g, open(gen, "w"))
    return str(dst)


def test_unsupported_architecture_is_named(t5_relu, tmp_path):
    path = _copy_with_config(t5_relu, tmp_path / "m", architectures=["PegasusForConditionalGeneration"],
                             model_type="t5")
    with pytest.raises(ValueError, match="PegasusForConditionalGeneration.*T5ForConditionalGeneration"):
        LLM(path, kv_cache_config=KV)


def test_checkpoint_without_start_token(t5_relu, tmp_path):
    path = _copy_with_config(t5_relu, tmp_path / "m", decoder_start_token_id=None, bos_token_id=None)
    with pytest.raises(ValueError, match="neither decoder_start_token_id nor bos_token_id"):
        LLM(path, kv_cache_config=KV)


def test_whisper_bad_audio(whisper):
    with LLM(whisper, dtype="float32", max_batch_size=4, kv_cache_config=KV) as llm:
        good = llm.generate_async({"prompt": "", "multi_modal_data": {"audio": [(np.zeros(16000, np.float32) + 0.01,
                                                                                  16000)]}},
                                  SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        with pytest.raises(ValueError, match="at most 30 s"):
            llm.generate({"prompt": "", "multi_modal_data": {"audio": [(np.zeros(16000 * 31, np.float32), 16000)]}})
        with pytest.raises(ValueError, match="44100 Hz does not match the checkpoint's 16000 Hz"):
            llm.generate({"prompt": "", "multi_modal_data": {"audio": [(np.zeros(44100, np.float32), 44100)]}})
        with pytest.raises(ValueError, match="exactly one audio clip"):
            llm.generate({"prompt": "", "multi_modal_data": {"audio": []}})
        with pytest.raises(ValueError, match="mono audio"):
            llm.generate({"prompt": "", "multi_modal_data": {"audio": [(np.zeros((16000, 2), np.float32), 16000)]}})
        for shape in ((), (2, 8000, 2)):    # not a wave: refused at submission, the engine keeps serving
            with pytest.raises(ValueError, match=r"1-D array of samples, got shape"):
                llm.generate({"prompt": "", "multi_modal_data": {"audio": [(np.zeros(shape, np.float32), 16000)]}})
        assert len(good.result(timeout=60).outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match="max_input_len=1024 is too small for Whisper"):
            LLM(whisper, max_input_len=1024, kv_cache_config=KV)


def test_overlap_scheduler_gives_the_same_tokens_and_never_emits_past_a_stop(t5_relu):
    """Overlap launches step N+1 before step N's stop checks ran: the results must not change."""
    prompts = [f"overlap {i} " + "y " * i for i in range(9)]
    with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=32, kv_cache_config=KV,
             disable_overlap_scheduler=True) as llm:
        free = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    # Stop each prompt at a token it produces mid-way, so stops land while the next step is in flight.
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[o.outputs[0].token_ids[3 + i % 5]]) for i, o in enumerate(free)]
    results = {}
    for overlap_off in (True, False):
        tiny = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_tokens=150)
        with LLM(t5_relu, dtype="float32", max_batch_size=8, max_input_len=32, kv_cache_config=tiny,
                 disable_overlap_scheduler=overlap_off) as llm:
            assert llm.engine.overlap is (not overlap_off)
            results[overlap_off] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                    for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.scheduler.self_pool.num_used_blocks == 0
    assert results[True] == results[False]
    for (ids, reason), p in zip(results[False], params):
        assert reason == "stop" and ids[-1] == p.stop_token_ids[0] and ids.count(p.stop_token_ids[0]) == 1


@pytest.mark.parametrize("family", ["bart", "whisper"])
@pytest.mark.parametrize("overlap_off", [True, False])
def test_prompt_fed_one_token_per_step_gives_the_same_tokens(family, overlap_off, request):
    """With CUDA graphs the scheduler feeds decoder prompts (BART's start + forced BOS, Whisper's
    4 tokens) one token per step; the outputs must not change. Forced here on the CPU."""
    import dataclasses

    path = request.getfixturevalue(family)
    if family == "whisper":
        rng = np.random.RandomState(0)
        prompts = [{"prompt": "", "multi_modal_data": {"audio": [((rng.randn(16000 * s) * 0.1).astype(np.float32),
                                                                   16000)]}} for s in (2, 5, 9)]
    else:
        prompts = ["one", "two words", "three words here"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = {}
    for one_by_one in (False, True):
        with LLM(path, dtype="float32", max_batch_size=4, kv_cache_config=KV,
                 disable_overlap_scheduler=overlap_off) as llm:
            sched = llm.engine.scheduler
            sched.limits = dataclasses.replace(sched.limits, feed_prompt_one_token_per_step=one_by_one)
            res = llm.generate(prompts, params, use_tqdm=False)
            outs[one_by_one] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
            assert all(o.metrics.first_token_time is not None for o in res)
    assert outs[True] == outs[False]


def test_kv_cache_usage_reports_both_pools(t5_llm):
    usage = t5_llm.kv_cache_usage()
    assert set(usage) == {"self", "cross"}
    assert usage["self"]["used_blocks"] == 0 and usage["self"]["total_blocks"] > 0
    assert usage["cross"]["tokens_per_block"] == KV.tokens_per_block
    assert t5_llm.queue_stats() == {"waiting": 0, "running": 0}


@pytest.mark.parametrize("dtype", ["auto", "float16", "bfloat16"])
def test_every_dtype_loads_and_generates(t5_relu, dtype):
    import torch

    with LLM(t5_relu, dtype=dtype, max_batch_size=2, kv_cache_config=KV) as llm:
        expected = {"auto": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        assert llm.engine.dtype == expected                  # auto on the CPU is float32
        assert next(llm.engine.runner.model.parameters()).dtype == expected
        out = llm.generate("dtype check", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5


def test_model_info_stats_and_health(t5_llm, t5_relu):
    info = t5_llm.model_info
    assert info["model_type"] == "t5" and info["dtype"] == "float32" and info["attn_backend"] == "torch"
    assert info["max_input_len"] == 64 and info["eos_token_ids"]
    assert t5_llm.stats()["kv"]["self"]["used_blocks"] == 0
    assert t5_llm.is_healthy and t5_llm.error is None
    llm = LLM(t5_relu, max_batch_size=2, kv_cache_config=KV)
    llm.shutdown()
    assert not llm.is_healthy
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate_async("after shutdown")


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "mbart", "whisper"])
def test_activation_profile_batch_stays_inside_the_model(family, request):
    """Start-up on the GPU runs the largest admissible encoder microbatch on dummy inputs to
    size the KV pools; every index must be valid (on the GPU a bad one is a device-side assert
    that kills the process: BART's position table is shorter than the default max_input_len)."""
    import torch

    path = request.getfixturevalue(family)
    with LLM(path, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5), max_batch_size=4) as llm:
        runner = llm.engine.runner
        inputs, meta = runner.dummy_encoder_batch(llm.engine.processor.max_input_len)
        with torch.no_grad():
            hidden = runner.model.encode(inputs, meta)
    assert hidden.shape[0] == sum(meta.seq_lens) and torch.isfinite(hidden).all()


def test_an_unset_cpu_budget_sizes_the_pools_from_the_machine(t5_relu):
    from enc2dec.engine.core.kv_sizing import AUTO_CPU_KV_MAX, auto_cpu_kv_budget

    with LLM(t5_relu, max_batch_size=2, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        plan = llm.engine.runner.kv_plan
        total = plan.self_bytes + plan.cross_bytes
        # a quarter of what is free (which moves a little between the two reads), never above the cap
        assert 0.5 * auto_cpu_kv_budget() <= total <= AUTO_CPU_KV_MAX
        out = llm.generate("budget check", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
