"""The engine core in its own process (``LlmArgs.engine_process``): the same outputs and handle
semantics as the in-process ``LLM``, and clean failure when the child dies."""
from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import textwrap

import httpx
import numpy as np
import pytest
import torch
from test_serve_helpers import KV, LiveServer, ServeConfig

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.engine_process import ProcessLLM

OPTIONS = dict(dtype="float32", max_batch_size=16, max_input_len=64, kv_cache_config=KV)
PROMPTS = ["translate the house is big", "a b c d e", "summarize: one two three four"]


@pytest.fixture(scope="module")
def pair(t5_relu):
    with LLM(t5_relu, **OPTIONS) as local, LLM(t5_relu, engine_process=True, **OPTIONS) as remote:
        assert isinstance(remote, ProcessLLM)
        yield local, remote


def _ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_outputs_match_the_in_process_engine_token_for_token(pair):
    local, remote = pair
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=6, n=2, temperature=0),
              SamplingParams(max_tokens=8, logprobs=2)]
    want, got = local.generate(PROMPTS, params, use_tqdm=False), remote.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in want]
    assert got[2].outputs[0].logprobs == want[2].outputs[0].logprobs
    assert got[0].prompt == want[0].prompt == PROMPTS[0]
    assert got[0].prompt_token_ids == want[0].prompt_token_ids and got[0].metrics.finished_time is not None
    assert remote.model_info == local.model_info


def test_streamed_outputs_are_cumulative_and_end_with_the_final_text(pair):
    local, remote = pair
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    want = [(o.outputs[0].text, o.outputs[0].logprobs)
            for o in local.generate_async(PROMPTS[0], params, streaming=True)]

    async def stream():
        return [o async for o in remote.generate_async(PROMPTS[0], params, streaming=True)]

    got = asyncio.run(stream())
    assert [(o.outputs[0].text, o.outputs[0].logprobs) for o in got] == want
    assert [len(o.outputs[0].token_ids) for o in got] == list(range(1, 13))
    assert got[-1].finished and not any(o.finished for o in got[:-1])
    assert got[-1].outputs[0].token_ids == local.generate(PROMPTS[0], params).outputs[0].token_ids


def test_abort_ends_the_request_and_frees_its_blocks(pair):
    _, remote = pair
    handle = remote.generate_async(PROMPTS[1], SamplingParams(max_tokens=4000, ignore_eos=True), streaming=True)
    next(iter(handle))
    handle.abort()
    final = handle.result(timeout=30)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    stats = remote.stats()
    assert stats["running"] == 0 and stats["kv"]["self"]["used_blocks"] == 0


def test_kv_peaks_show_a_request_that_ended_before_anyone_looked(pair):
    # The bench reads the peak after a level; a request of a small model can end between two polls.
    for llm in pair:
        llm.reset_kv_peaks()
        assert llm.kv_cache_usage()["self"]["peak_used_blocks"] == 0
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        usage = llm.kv_cache_usage()
        assert usage["self"]["used_blocks"] == 0 and usage["self"]["peak_used_blocks"] >= 1
        assert usage["cross"]["peak_used_blocks"] >= 1
        llm.reset_kv_peaks()
        assert llm.kv_cache_usage()["self"]["peak_used_blocks"] == 0


def test_bad_requests_raise_the_in_process_errors(pair):
    local, remote = pair
    bad = SamplingParams(top_k=10**9)
    for prompt, params in (("x", bad), ("word " * 200, None), ({"prompt_token_ids": []}, None)):
        with pytest.raises(ValueError) as want:
            local.generate_async(prompt, params)
        with pytest.raises(ValueError) as got:
            remote.generate_async(prompt, params)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="^prompt 1: "):
        remote.generate(["fine", "x"], [SamplingParams(max_tokens=2), bad])
    assert remote.stats()["waiting"] == 0 and remote.is_healthy


def _vocab_size(core, plus: int) -> int:
    return core.processor.vocab_size + plus


def test_call_on_engine_runs_a_picklable_function_in_the_engine(pair):
    local, remote = pair
    assert remote.call_on_engine(functools.partial(_vocab_size, plus=1)).result(30) == \
        local.call_on_engine(functools.partial(_vocab_size, plus=1)).result(30)
    with pytest.raises(TypeError, match="picklable"):
        remote.call_on_engine(lambda core: 1)


def test_a_bad_model_path_fails_as_in_process(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(Exception) as want:
        LLM(missing, **OPTIONS)
    with pytest.raises(Exception) as got:
        LLM(missing, engine_process=True, **OPTIONS)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_killing_the_engine_process_fails_pending_requests_and_health(t5_relu):
    cfg = ServeConfig(model=t5_relu)
    server = LiveServer(cfg, lambda: LLM(t5_relu, engine_process=True, **OPTIONS)).start()
    try:
        llm = server.llm
        assert httpx.get(server.url + "/health").status_code == 200
        handle = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True), streaming=True)
        next(iter(handle))
        llm._proc.kill()
        final = handle.result(timeout=30)
        assert final.finished and final.outputs[0].finish_reason == "abort" and "died" in final.error
        assert not llm.is_healthy
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        with pytest.raises(RuntimeError, match="died"):
            llm.generate_async(PROMPTS[0])
    finally:
        server.stop()


def test_whisper_transcripts_match_the_in_process_engine(real_whisper, real_tiny_llm):
    from enc2dec.engine.whisper.transcribe import transcribe

    rows, audio = real_whisper.clips()
    audio = audio[:2]
    want = transcribe(real_tiny_llm, audio, word_timestamps=True)
    with LLM(str(real_whisper.tiny_en), kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5),
             engine_process=True) as remote:
        got = transcribe(remote, audio, word_timestamps=True)
        out = remote.generate({"prompt": "", "multi_modal_data": {"audio": [audio[0]]}})
    assert [t.text for t in got] == [t.text for t in want]
    assert [[w.word for s in t.segments for w in s.words] for t in got] == \
        [[w.word for s in t.segments for w in s.words] for t in want]
    ref = real_tiny_llm.generate({"prompt": "", "multi_modal_data": {"audio": [audio[0]]}})
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert np.isfinite(len(out.outputs[0].token_ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_the_parent_never_initialises_cuda_and_outputs_match(flan_t5, tmp_path):
    # A fresh interpreter: in this one an earlier GPU test may already have initialised CUDA.
    script = tmp_path / "remote.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch
        from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
        if __name__ == "__main__":
            params = SamplingParams(max_tokens=16, ignore_eos=True)
            with LLM({str(flan_t5)!r}, engine_process=True, **{dict(OPTIONS, dtype="bfloat16", device="cuda")!r}) as llm:
                got = llm.generate({PROMPTS!r}, params, use_tqdm=False)
                streamed = [o.outputs[0].text for o in llm.generate_async({PROMPTS[0]!r}, params, streaming=True)]
                print(json.dumps({{"ids": [o.outputs[0].token_ids for o in got], "streamed": streamed[-1],
                                  "cuda_in_parent": torch.cuda.is_initialized()}}))
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    remote = json.loads(run.stdout.strip().splitlines()[-1])
    assert remote["cuda_in_parent"] is False                  # CUDA lives in the engine process only
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLM(flan_t5, **dict(OPTIONS, dtype="bfloat16", device="cuda")) as local:
        want = local.generate(PROMPTS, params, use_tqdm=False)
    assert remote["ids"] == [o.outputs[0].token_ids for o in want] and remote["streamed"] == want[0].outputs[0].text


def test_serve_defaults_to_an_engine_process_unless_the_config_or_option_says_no(tmp_path):
    from enc2dec.cli.serve import SERVE_ENGINE_DEFAULTS
    from enc2dec.engine.launch import build_llm_args

    assert build_llm_args("m", defaults=SERVE_ENGINE_DEFAULTS).engine_process is True
    assert build_llm_args("m", engine_process=False, defaults=SERVE_ENGINE_DEFAULTS).engine_process is False
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine_process: false\n")
    assert build_llm_args("m", str(cfg), defaults=SERVE_ENGINE_DEFAULTS).engine_process is False
    assert build_llm_args("m").engine_process is False          # bench, eval, transcribe: one process
    with pytest.raises(ValueError, match="engine_process must be true or false"):
        build_llm_args("m", engine_process="yes")
