"""The sampling step never waits for the GPU: run under CUDA's sync debug mode, which raises on
any blocking copy or stream synchronisation. Run on a GPU with `pytest -m gpu`."""
import pytest
import torch
from gpu_sync import queue_busy_work, syncs_raise

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.runner.sampler import BeamGroup, Sampler, SeqSamplingState
from enc2dec.engine.runner.sampling_ops import stream_key

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EOS, STOP, VOCAB = 1, 7, 32128


def _state(seed=None, index=0, **params) -> SeqSamplingState:
    p = SamplingParams(seed=seed, **params)
    return SeqSamplingState(p, (EOS,), tuple(p.stop_token_ids or ()), suppress_token_ids=(3,),
                            stream=stream_key(seed, index) if seed is not None and not p.is_greedy else None)


BEAM = _state(use_beam_search=True, best_of=2, temperature=0.0)
# greedy, sampled, seeded, min_tokens and stop-token rows, with logprobs, then two beams
STATES = [_state(temperature=0.0), _state(temperature=0.8, top_p=0.9), _state(seed=11, temperature=1.0, top_k=50),
          _state(seed=12, min_p=0.05, logprobs=2), _state(temperature=0.0, min_tokens=4, max_tokens=8),
          _state(seed=13, temperature=0.7, min_tokens=4, max_tokens=8, stop_token_ids=[STOP]),
          _state(temperature=1.0, stop_token_ids=[STOP], logprobs=0), BEAM, BEAM]
NUM_OUT = [0, 3, 1, 2, 1, 2, 5, 1, 1]


def _step(sampler, logits):
    sample = sampler.sample(logits, STATES, NUM_OUT, [BeamGroup(7, 2, 4)], [-0.5, -0.7])
    sample = sample.to_host(non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return sample, event


def test_sampling_step_does_not_sync_with_the_host():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(len(STATES), VOCAB, device="cuda", generator=gen)          # [S, V]
    logits[:, EOS] = logits[:, STOP] = 30.0                                          # tempting everyone to stop
    sampler = Sampler()
    _step(sampler, logits)[1].synchronize()      # warm-up: lazy CUDA init and cached constants may sync once
    torch.cuda.synchronize()
    with syncs_raise():
        queue_busy_work(20)
        sample, event = _step(sampler, logits)
    event.synchronize()
    out = sample.output()
    ids = out.token_ids
    assert ids[0] == EOS and ids[4] != EOS and ids[5] not in (EOS, STOP)       # min_tokens masks the stop ids
    assert all(t != 3 for t in ids)                                            # the suppressed token
    assert out.logprobs is not None and set(out.top_logprobs[3]) >= {ids[3]} and len(out.beams) == 1
    again, event = _step(sampler, logits)
    event.synchronize()
    assert again.output().token_ids[2:4] == ids[2:4]                            # seeded rows repeat


def test_engine_steps_with_overlap_sample_without_syncing(t5_relu):
    """The real engine's sampler calls, with its states and overlap on, run under the debug mode
    (only they: the rest of the step is not this test's subject)."""
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, ignore_eos=True),   # fixed length:
              # the batch shapes, and so the bf16 logits, repeat from run to run
              SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3, n=2, min_tokens=5),
              SamplingParams(max_tokens=12, min_p=0.1, seed=4, stop_token_ids=[5], logprobs=1)]
    prompts = [f"prompt number {i}" for i in range(len(params))]
    with LLM(t5_relu, dtype="bfloat16", max_batch_size=8, kv_cache_config=kv) as llm:
        assert llm.engine.overlap
        first = llm.generate(prompts, params, use_tqdm=False)          # warm-up
        runner = llm.engine.runner
        inner, calls = runner.sampler.sample, []

        def strict_sample(*args, **kwargs):
            with syncs_raise():
                out = inner(*args, **kwargs)
            calls.append(len(args[1]))
            return out

        runner.sampler.sample = strict_sample
        try:
            second = llm.generate(prompts, params, use_tqdm=False)
        finally:
            runner.sampler.sample = inner
    assert calls and max(calls) > 1                                    # rows of several kinds sampled together
    assert [o.token_ids for o in second[2].outputs] == [o.token_ids for o in first[2].outputs]
    assert second[3].outputs[0].token_ids == first[3].outputs[0].token_ids
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_every_kind_of_row_steps_together_without_syncing(whisper_ts):
    """The issue's must-show: greedy, sampled, seeded, min_tokens, stop-token, timestamped and
    language-detecting Whisper requests decode in the same steps, overlap on, and every engine
    step (schedule, launch, resolve) runs under the sync debug mode."""
    import numpy as np
    from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules
    from enc2dec.engine.whisper.tokens import engine_whisper_info

    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)
    with LLM(whisper_ts, dtype="bfloat16", max_batch_size=16, kv_cache_config=kv) as llm:
        assert llm.engine.overlap
        tok, _, _ = engine_whisper_info(llm)
        assert tok.has_timestamps
        lang = next(iter(tok.languages))
        forced = tok.forced_after_language("transcribe", True)

        def timestamped(begin=0):
            return TimestampRules(begin, tok.eot, tok.no_timestamps, tok.timestamp_begin, 50)

        def clip(prefix, i):
            wave = np.random.default_rng(i).standard_normal(16000 * (2 + i)).astype(np.float32) * 0.1
            return {"prompt": "".join(llm.tokenizer.convert_ids_to_tokens(prefix)),
                    "multi_modal_data": {"audio": [(wave, 16000)]}}

        plain, with_ts = tok.prefix(lang, "transcribe", False), tok.prefix(lang, "transcribe", True)
        rows = [(plain, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
                (plain, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, ignore_eos=True)),
                (plain, SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3, n=2, ignore_eos=True)),
                (plain, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6)),
                (plain, SamplingParams(max_tokens=12, min_p=0.1, seed=4, stop_token_ids=[5], logprobs=1)),
                (with_ts, SamplingParams(max_tokens=12, temperature=0.0, detokenize=False,
                                         logits_processors=[timestamped()])),
                (with_ts, SamplingParams(max_tokens=12, temperature=0.8, seed=5, detokenize=False,
                                         logits_processors=[timestamped()])),
                ([tok.sot], SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, logits_processors=[
                    DetectLanguage(list(tok.languages.values()), forced),
                    SuppressAtBegin(1 + len(forced), tok.begin_suppress), timestamped(1 + len(forced))]))]
        prompts = [clip(prefix, i) for i, (prefix, _) in enumerate(rows)]
        params = [p for _, p in rows]
        first = llm.generate(prompts, params, use_tqdm=False)          # warm-up: lazy init may sync once
        core = llm.engine
        inner, steps = core.step, []

        def strict_step():
            with syncs_raise():
                out = inner()
            steps.append(len(core.scheduler.running))
            return out

        core.step = strict_step
        try:
            second = llm.generate(prompts, params, use_tqdm=False)
        finally:
            core.step = inner
    assert steps and max(steps) == len(rows)                           # all kinds in the same steps
    for i in (0, 2, 4, 5, 6, 7):                                        # greedy and seeded rows repeat
        assert [o.token_ids for o in second[i].outputs] == [o.token_ids for o in first[i].outputs], i
    assert len(second[3].outputs[0].token_ids) >= 6
    for out in (second[5], second[6], second[7]):
        stamps = [t for t in out.outputs[0].token_ids if t >= tok.timestamp_begin]
        assert stamps == sorted(stamps)
    assert second[5].outputs[0].token_ids[0] >= tok.timestamp_begin    # the text opens with a timestamp
    assert second[7].outputs[0].token_ids[0] in tok.languages.values()
    assert second[7].outputs[0].token_ids[1:1 + len(forced)] == forced


def test_whisper_beam_rows_apply_their_rules_without_syncing():
    """Beam rows with language detection, begin-suppress and the timestamp grammar: the batched
    rules over the beams' host ids stage their windows without waiting for the GPU, and propose
    the candidates the CPU proposes."""
    from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules

    vocab, eot, no_ts, ts = 300, 100, 199, 200
    rules = [DetectLanguage([150, 151], [160, 161]), SuppressAtBegin(3, (eot, 7)), TimestampRules(3, eot, no_ts, ts, 50)]
    state = SeqSamplingState(SamplingParams(max_tokens=20, use_beam_search=True, best_of=3, logits_processors=rules),
                             (eot,), (), suppress_token_ids=(3,))
    # A group mid-text (text, a lone stamp, a closed pair) and one at its first forced token.
    histories = [[150, 160, 161, ts, 5], [150, 160, 161, ts, 5, ts + 4], [150, 160, 161, ts, ts + 2, ts + 2], [151]]
    groups = [BeamGroup(0, 3, 6), BeamGroup(3, 1, 2)]
    logits = torch.randn(len(histories), vocab, generator=torch.Generator().manual_seed(0)) * 3    # [S, V]

    on = {"cpu": logits, "cuda": logits.cuda()}        # staged before the strict part: a test copy, not the step's

    def step(sampler, device):
        return sampler.sample(on[device], [state] * len(histories), list(map(len, histories)), groups,
                              [-1.0, -1.2, -1.1, -0.4], histories, list(range(len(histories))))

    sampler = Sampler()
    step(sampler, "cuda").beams.output()       # warm-up: lazy CUDA init and cached constants may sync once
    torch.cuda.synchronize()
    with syncs_raise():
        queue_busy_work(20)
        sample = step(sampler, "cuda").to_host(non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    event.synchronize()
    got, want = sample.beams.output(), step(Sampler(), "cpu").beams.output()
    # The same candidates; the log-probabilities round differently on the two devices. A group
    # with fewer allowed tokens than candidates (the forced first token) fills up with banned
    # ones at -inf, whose order is the device's top-k tie order: there only the score counts.
    finite = [[(p, t) if c > float("-inf") else None for p, t, c, _ in g] for g in want]
    assert [[(p, t) if c > float("-inf") else None for p, t, c, _ in g] for g in got] == finite
    assert sum(x is None for g in finite for x in g) == 1      # the forced group's second candidate
    assert [[(c, lp) for _, _, c, lp in g] for g in got] == \
        [[pytest.approx((c, lp), abs=1e-5) for _, _, c, lp in g] for g in want]
