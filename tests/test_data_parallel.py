"""Data parallelism on one host (``data_parallel_size`` / ``--dp-size``): N engine processes
behind one front give the one-engine outputs, spread requests by load, survive a replica's
death, and are reported per replica by serve's /health and /metrics."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from test_serve_helpers import KV, LiveServer, ServeConfig, httpx

from enc2dec.engine import LLM, LlmArgs, SamplingParams
from enc2dec.engine.data_parallel import DataParallelLLM, placements, replica_kv_config

OPTIONS = dict(dtype="float32", max_batch_size=16, max_input_len=64, kv_cache_config=KV)
PROMPTS = ["translate the house is big", "a b c d e", "summarize: one two three four", "hello world",
           "machine translation is fun", "the lazy dog", "numbers like 1234", "un chat noir"]
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(t5_relu):
    with LLM(t5_relu, **OPTIONS) as one, LLM(t5_relu, data_parallel_size=2, **OPTIONS) as dp:
        assert isinstance(dp, DataParallelLLM) and len(dp.replicas) == 2
        yield one, dp


def _routed(llm) -> list[int]:
    return [r["routed"] for r in llm.stats()["replicas"]]


def _wait_until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_greedy_outputs_match_one_engine_and_a_batch_spreads_over_both(pair):
    one, dp = pair
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=6, n=2, temperature=0),
              SamplingParams(max_tokens=8, logprobs=2)] + [SamplingParams(max_tokens=9)] * (len(PROMPTS) - 3)
    before = _routed(dp)
    want, got = one.generate(PROMPTS, params, use_tqdm=False), dp.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    # Each replica runs on its share of the cores: the same tokens, and log-probabilities to
    # float32 rounding (how a kernel splits its work among threads may round differently; an
    # AVX2 machine did).
    for g, w in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) <= 1e-5 for t in g), (g, w)
    assert [o.prompt for o in got] == PROMPTS
    spread = [b - a for a, b in zip(before, _routed(dp))]
    assert sum(spread) == len(PROMPTS) and min(spread) >= 3, spread
    streamed = [o.outputs[0].text for o in dp.generate_async(PROMPTS[0], params[0], streaming=True)]
    assert streamed[-1] == want[0].outputs[0].text and len(streamed) > 1
    assert dp.model_info == {**one.model_info, "data_parallel_size": 2}


def test_a_new_request_goes_to_the_replica_with_fewer_sequences_in_flight(pair):
    _, dp = pair
    busy = dp.generate_async(PROMPTS[0], LONG, streaming=True)
    next(iter(busy))
    before = _routed(dp)
    busy_replica = next(i for i, r in enumerate(dp.stats()["replicas"]) if r["running"] == 1)
    for prompt in PROMPTS[:3]:       # one at a time: the busy replica always holds more
        assert dp.generate(prompt, SamplingParams(max_tokens=4)).outputs[0].finish_reason in ("stop", "length")
    spread = [b - a for a, b in zip(before, _routed(dp))]
    assert spread[busy_replica] == 0 and sum(spread) == 3, spread
    busy.abort()
    assert busy.result(timeout=30).outputs[0].finish_reason == "abort"
    _wait_until(lambda: dp.stats()["running"] == 0)
    assert dp.stats()["kv"]["self"]["used_blocks"] == 0


def test_a_bad_prompt_fails_the_whole_batch_and_names_its_index(pair):
    _, dp = pair
    bad = SamplingParams(top_k=10**9)
    # Prompt 3 lands on the second replica as its second prompt: the index is the caller's.
    with pytest.raises(ValueError, match="^prompt 3: "):
        dp.generate(PROMPTS[:4], [SamplingParams(max_tokens=2000, ignore_eos=True)] * 3 + [bad], use_tqdm=False)
    _wait_until(lambda: dp.stats()["running"] + dp.stats()["waiting"] == 0)
    assert dp.is_healthy


def _threads_and_env(core) -> tuple[int, str | None]:
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_each_cpu_replica_gets_its_share_of_the_cores(pair):
    _, dp = pair
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    assert dp.call_on_engine(_threads_and_env).result(30) == (share, str(share))


def test_gpu_groups_follow_the_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    got = placements(LlmArgs(data_parallel_size=2, tensor_parallel_size=2))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in got] == ["3,5", "6,7"] and got[0].num_threads is None
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements(LlmArgs(data_parallel_size=4))] == ["3", "5", "6", "7"]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 needs 6 GPUs, but 4 are"):
        placements(LlmArgs(data_parallel_size=3, tensor_parallel_size=2))


def test_cpu_replicas_split_one_automatic_kv_budget_and_keep_a_set_one(monkeypatch):
    import torch

    from enc2dec.engine import KvCacheConfig

    places = placements(LlmArgs(data_parallel_size=4, device="cpu"))
    unset = KvCacheConfig(cross_kv_cache_fraction=0.5)
    assert replica_kv_config(unset, places, available=16 << 30).max_cpu_memory_bytes == (4 << 30) // 4
    assert replica_kv_config(KvCacheConfig(max_cpu_memory_bytes=1 << 30), places).max_cpu_memory_bytes == 1 << 30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpu = placements(LlmArgs(data_parallel_size=2))
    assert replica_kv_config(unset, gpu).max_cpu_memory_bytes is None      # GPU replicas size from their own GPU


@pytest.mark.parametrize("data, pattern", [
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1, got 0"),
    ({"data_parallel_size": "2"}, "data_parallel_size must be an integer >= 1"),
    ({"data_parallel_size": 2, "device": "cuda:1"}, "device='cuda:1' with data_parallel_size=2.*CUDA_VISIBLE_DEVICES"),
])
def test_config_validation_names_the_option(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        LlmArgs.from_dict(data)


def test_killing_a_replica_fails_its_requests_while_the_other_serves(t5_relu):
    server = LiveServer(ServeConfig(model=t5_relu), lambda: LLM(t5_relu, data_parallel_size=2, **OPTIONS)).start()
    try:
        dp = server.llm
        r = httpx.get(server.url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "replicas": [
            {"replica": i, "status": "ok", "pid": dp.replicas[i].pid} for i in range(2)]}
        handles = [dp.generate_async(PROMPTS[i], LONG, streaming=True) for i in range(2)]
        for h in handles:
            next(iter(h))
        assert _routed(dp) == [1, 1]
        os.kill(dp.replicas[1].pid, signal.SIGKILL)
        _wait_until(lambda: any(h.done() for h in handles))
        dead, = [h.result() for h in handles if h.done()]
        assert dead.outputs[0].finish_reason == "abort" and "replica 1" in dead.error and "died" in dead.error
        alive, = [h for h in handles if not h.done()]      # the other replica's request still decodes
        assert dp.is_healthy
        alive.abort()

        h = httpx.get(server.url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert [r["status"] for r in h.json()["replicas"]] == ["ok", "failed"]
        assert "died" in h.json()["replicas"][1]["error"]
        for _ in range(3):             # new requests go to the live replica
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 4},
                           timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        m = server.wait_idle()
        assert m['enc2dec_replica_healthy{replica="0"}'] == 1 and m['enc2dec_replica_healthy{replica="1"}'] == 0
        assert m['enc2dec_replica_requests_routed_total{replica="0"}'] == 4
        assert m['enc2dec_replica_requests_routed_total{replica="1"}'] == 1
        assert m['enc2dec_replica_kv_blocks_total{pool="self",replica="0"}'] == m['enc2dec_kv_blocks_total{pool="self"}']
        assert not any('replica="1"' in k and "kv_blocks" in k for k in m)

        os.kill(dp.replicas[0].pid, signal.SIGKILL)
        _wait_until(lambda: not dp.is_healthy)
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "every replica has died" in h.json()["error"] and len(h.json()["replicas"]) == 2
        with pytest.raises(RuntimeError, match="every replica has died"):
            dp.generate_async(PROMPTS[0])
    finally:
        server.stop()


def test_bench_and_eval_with_dp_size_2_through_the_cli(t5_relu, tmp_path, monkeypatch):
    from enc2dec.bench import runner
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    started = []
    real_start = runner.start_llm
    monkeypatch.setattr(runner, "start_llm", lambda args: started.append(real_start(args)) or started[-1])
    config = tmp_path / "engine.yaml"
    config.write_text("kv_cache_config:\n  tokens_per_block: 4\n  max_cpu_memory_bytes: 33554432\n")
    report = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--quiet", "--model", t5_relu, "--config", str(config), "--dtype",
                                 "float32", "--dp-size", "2", "--concurrency", "4", "--num-requests", "8",
                                 "--warmup", "0", "--input-len", "8", "--output-len", "4",
                                 "--report-json", str(report)])
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert rep["engine_args"]["data_parallel_size"] == 2 and rep["levels"][0]["output_tokens"] == 8 * 4
    assert isinstance(started[0], DataParallelLLM) and sum(_routed(started[0])) == 8 and min(_routed(started[0])) >= 2

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"source": s, "target": s.upper()}) + "\n" for s in PROMPTS))
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(app, ["eval", "--quiet", "--warmup", "0", "--task", "translation", "--model", t5_relu,
                                 "--data", str(data), "--config", str(config), "--max-tokens", "8",
                                 "--batch-size", "3", "--dp-size", "2", "--min-parity", "1.0",
                                 "--report-json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["parity"]["exact_match"] == 1.0        # the same ids as transformers

    r = CliRunner().invoke(app, ["bench", "--quiet", "--model", t5_relu, "--dp-size", "0"])
    assert r.exit_code == 2 and "data_parallel_size must be an integer >= 1" in r.output


def test_dp_size_with_a_ray_address_is_a_usage_error(t5_relu):
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["serve", t5_relu, "--dp-size", "2", "--ray-address", "local"])
    assert r.exit_code == 2 and "--dp-size with --ray-address" in r.output
    r = CliRunner().invoke(app, ["serve", t5_relu, "--dp-size", "0"])
    assert r.exit_code == 2 and "data_parallel_size must be an integer >= 1" in r.output


@pytest.mark.real
def test_transcribe_with_dp_size_2_writes_the_same_text_as_one_engine(real_whisper, tmp_path, monkeypatch):
    """The real whisper-tiny.en over the LibriVox clips: two CPU replicas share the files, and
    each file's text is as one engine writes it."""
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    routed = []
    real_shutdown = DataParallelLLM.shutdown

    def shutdown(self):
        if not routed:
            routed.extend(_routed(self))
        real_shutdown(self)
    monkeypatch.setattr(DataParallelLLM, "shutdown", shutdown)

    rows = [json.loads(line) for line in open(real_whisper.manifest)][:4]
    clips = [str(real_whisper.manifest.parent / row["audio"]) for row in rows]
    texts = {}
    for dp in ("1", "2"):
        out = tmp_path / f"dp{dp}"
        r = CliRunner().invoke(app, ["transcribe", *clips, "--model", str(real_whisper.tiny_en), "-f", "txt",
                                     "-o", str(out), "--dp-size", dp])
        assert r.exit_code == 0, r.output
        texts[dp] = {p.name: p.read_text() for p in sorted(out.glob("*.txt"))}
    assert len(texts["1"]) == len(clips) and all(texts["1"].values())
    assert texts["2"] == texts["1"]
    assert len(routed) == 2 and min(routed) >= 1          # both replicas decoded windows
