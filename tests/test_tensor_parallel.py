"""Tensor parallelism on the CPU: gloo, the driver plus one worker process.

TP=2 must give the tokens of TP=1 (and the same logprobs up to float32 summation order),
refuse sizes the model or machine cannot run before any weight loads, and turn a killed
worker into a clear error instead of a hang, leaving no process behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading

import numpy as np
import pytest
import torch

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams

PROMPTS = [
    "translate English to German: The house is wonderful.",
    "summarize: the quick brown fox jumps over the lazy dog again and again while the cat sleeps",
    "hello",
    "a b c d e f g h i j k l m n o p",
]
MAX_TOKENS = 10
KV = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_cpu_memory_bytes=64 << 20)


def _llm(path, tp: int, **kw):
    return LLM(path, dtype="float32", max_batch_size=8, kv_cache_config=KV, tensor_parallel_size=tp, **kw)


def _inputs(family: str):
    if family != "whisper":
        return PROMPTS
    rng = np.random.RandomState(0)
    return [{"prompt": "", "multi_modal_data": {"audio": [((rng.randn(16000 * s) * 0.1).astype(np.float32), 16000)]}}
            for s in (3, 11)]


def _generate(path, tp: int, inputs, params):
    with _llm(path, tp) as llm:
        outs = llm.generate(inputs, params, use_tqdm=False)
        pids = list(llm.engine.runner.worker_pids) if tp > 1 else []
    return [o.outputs[0] for o in outs], pids


def _tp_worker_children() -> list[int]:
    """Live (not zombie) worker processes started by this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"enc2dec.engine.parallel.worker" in cmdline:
            found.append(int(entry))
    return found


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:           # reaped children vanish; zombies do not count
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "whisper"])
def test_tp2_greedy_matches_tp1(family, request):
    path = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    ref, _ = _generate(path, 1, _inputs(family), params)
    got, pids = _generate(path, 2, _inputs(family), params)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        for lp_r, lp_g in zip(r.logprobs, g.logprobs):
            assert lp_g.keys() == lp_r.keys()
            assert np.allclose(list(lp_g.values()), list(lp_r.values()), atol=1e-4)
    assert pids and not any(_is_running(p) for p in pids)        # the context manager stopped the worker


def test_tp2_sampling_state_stays_on_the_driver(t5_relu):
    """Seeded sampling and a (non-picklable) logits processor: rank 0 samples for every rank."""
    banned = 4

    def ban(ids, logits):
        logits[banned] = -float("inf")

    params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2, logits_processors=[ban])
    with _llm(t5_relu, 1) as llm:
        ref = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    with _llm(t5_relu, 2) as llm:
        got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        assert all(banned not in c.token_ids for c in g.outputs)


def test_tp2_a_failing_logits_processor_fails_its_step_only(t5_relu):
    def boom(ids, logits):
        raise RuntimeError("boom")

    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    with _llm(t5_relu, 1) as llm:
        ref = llm.generate(PROMPTS, greedy, use_tqdm=False)
    with _llm(t5_relu, 2) as llm:
        failed = llm.generate("hello", SamplingParams(max_tokens=6, logits_processors=[boom]))
        assert "boom" in failed.error and failed.outputs[0].finish_reason == "abort"
        got = llm.generate(PROMPTS, greedy, use_tqdm=False)         # the ranks are still in step
        assert llm.is_healthy
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


@pytest.fixture
def t5_config_only(t5_relu, tmp_path):
    """The tiny T5's config and tokenizer without weights: loading any weight would fail."""
    folder = tmp_path / "no_weights"
    shutil.copytree(t5_relu, folder, ignore=shutil.ignore_patterns("*.bin", "*.safetensors*"))
    return str(folder)


@pytest.mark.parametrize("tp, message", [
    (3, r"tensor_parallel_size=3 does not divide the encoder attention heads 4, decoder attention heads 4, "
        r"cross-attention heads 4.*valid sizes for this model: 1, 2, 4"),
    (8, r"tensor_parallel_size=8 does not divide .*heads 4"),
])
def test_tp_size_must_divide_the_heads(t5_config_only, tp, message):
    with pytest.raises(ValueError, match=message):
        _llm(t5_config_only, tp)


def test_tp_size_over_the_visible_gpus_is_refused(t5_config_only, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs, but 1 is visible"):
        _llm(t5_config_only, 2, device="cuda")
    with pytest.raises(ValueError, match=r"rank r always runs on cuda:r"):
        _llm(t5_config_only, 2, device="cuda:1")


def test_a_checkpoint_that_fails_to_load_stops_every_rank(t5_relu, tmp_path):
    import json

    folder = tmp_path / "mismatch"
    shutil.copytree(t5_relu, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_ff": 2 * config["d_ff"]}))
    with pytest.raises(ValueError, match="has shape .* the model expects"):
        _llm(str(folder), 2)
    assert _tp_worker_children() == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the engine thread's end
def test_killed_worker_is_a_clear_error_not_a_hang(t5_relu):
    llm = _llm(t5_relu, 2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        assert len(llm.generate("hello", params).outputs[0].token_ids) == 4
        (pid,) = llm.engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        caught: list[BaseException] = []

        def run():
            try:
                llm.generate(PROMPTS, params, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - inspected below
                caught.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "generate hung after a tensor-parallel worker was killed"
        assert caught and isinstance(caught[0], RuntimeError)
        assert "tensor-parallel worker 1 died (exit code -9, SIGKILL)" in str(caught[0])
        assert not llm.is_healthy
        with pytest.raises(RuntimeError, match="tensor-parallel worker 1 died"):
            llm.generate("again", params)
    finally:
        llm.shutdown()
    assert not _is_running(pid)


def _cli(*args):
    from typer.testing import CliRunner

    from enc2dec.cli.main import app

    r = CliRunner().invoke(app, list(args))
    return r.exit_code, " ".join(r.output.split())


@pytest.mark.parametrize("command", ["bench", "eval", "transcribe"])
def test_every_command_takes_tp_size(command, t5_relu, whisper, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"source": "hello", "target": "hallo"}\n')
    args = {"bench": ["bench", "--quiet", "--model", t5_relu, "--concurrency", "1", "--num-requests", "1"],
            "eval": ["eval", "--quiet", "--task", "translation", "--model", t5_relu, "--data", str(data),
                     "--reference", "none"],
            "transcribe": ["transcribe", "--quiet", "--model", whisper, str(data)]}[command]
    code, output = _cli(*args, "--tp-size", "3")
    assert code == 2, output
    assert "tensor_parallel_size=3 does not divide the encoder attention heads 4" in output


def test_bench_runs_with_tp_size_2(t5_relu, tmp_path):
    import json

    report = tmp_path / "r.json"
    code, output = _cli("bench", "--quiet", "--model", t5_relu, "--device", "cpu", "--concurrency", "1,2",
                        "--num-requests", "2", "--warmup", "0", "--input-len", "8", "--output-len", "4",
                        "--tp-size", "2", "--report-json", str(report))
    assert code == 0, output
    rep = json.loads(report.read_text())
    assert rep["engine_args"]["tensor_parallel_size"] == 2 and "--tp-size 2" in rep["command"]
    assert all(lv["output_tokens"] == 2 * 4 for lv in rep["levels"])


def test_tp2_beam_search_equals_tp1(bart):
    """Beam forks (block copies, host-resolved beam tokens) reach the worker rank too."""
    params = SamplingParams(max_tokens=MAX_TOKENS, use_beam_search=True, best_of=3, n=3, temperature=0.0)

    def run(tp):
        with LLM(bart, dtype="float32", max_batch_size=12, max_beam_width=3, kv_cache_config=KV,
                 tensor_parallel_size=tp) as llm:
            return [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    single, sharded = run(1), run(2)
    assert all(len(hyps) == 3 for hyps in single)
    assert [[c.token_ids for c in h] for h in sharded] == [[c.token_ids for c in h] for h in single]
    for h1, h2 in zip(single, sharded):
        assert [c.cumulative_logprob for c in h2] == pytest.approx([c.cumulative_logprob for c in h1], abs=1e-4)
