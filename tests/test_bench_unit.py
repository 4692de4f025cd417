"""bench library against a fake engine: workloads, metrics, thresholds, the closed loop.

The fake has the LLM API's shape (generate_async -> awaitable / async-iterable handle,
RequestOutput with RequestMetrics) and a fixed step time, so these tests need no model.
"""
from __future__ import annotations

import asyncio

import pytest
from enc2dec.bench import metrics, session, thresholds, workloads
from enc2dec.bench.errors import BenchInputError
from fake_engine import VOCAB, FakeLLM


# ---- workloads -----------------------------------------------------------------------------------
def test_length_distributions_are_seeded_and_exact_when_fixed():
    import random

    assert workloads.LengthDist.parse("fixed", 32, "--input-dist").sample(5, random.Random(0)) == [32] * 5
    normal = workloads.LengthDist.parse("normal:8", 64, "--input-dist")
    a, b = normal.sample(50, random.Random(3)), normal.sample(50, random.Random(3))
    assert a == b and len(set(a)) > 5 and min(a) >= 1
    uni = workloads.LengthDist.parse("uniform:10", 50, "--input-dist").sample(200, random.Random(1))
    assert 40 <= min(uni) and max(uni) <= 60
    for bad in ("gauss", "normal:x", "fixed:3", "uniform:-1"):
        with pytest.raises(BenchInputError, match="--input-dist"):
            workloads.LengthDist.parse(bad, 32, "--input-dist")


def test_synthetic_requests_stay_inside_the_vocabulary():
    d = workloads.LengthDist.parse("fixed", 20, "x")
    reqs = workloads.synthetic_requests(10, d, workloads.LengthDist.parse("fixed", 7, "x"), seed=5, vocab_size=VOCAB)
    assert all(len(r.prompt) == r.input_len == 20 and r.output_len == 7 for r in reqs)
    assert all(0 < t < VOCAB for r in reqs for t in r.prompt)
    again = workloads.synthetic_requests(10, d, d, seed=5, vocab_size=VOCAB)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]


def test_jsonl_rows_and_a_bad_row_named_by_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"input_ids": [5, 6, 7], "output_tokens": 4}\n\n{"prompt": "hello", "task_id": 2}\n')
    reqs = workloads.load_jsonl(str(good), default_output_len=9)
    assert [(r.input_len, r.output_len, r.is_text) for r in reqs] == [(3, 4, False), (0, 9, True)]
    for line, message in (('{"input_ids": [], "output_tokens": 3}', "input_ids"),
                          ('{"input_ids": [1], "output_tokens": 0}', "output_tokens"),
                          ('{"text": "x"}', "needs 'input_ids'"), ("{not json", "not valid JSON")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"input_ids": [1, 2], "output_tokens": 3}\n' + line + "\n")
        with pytest.raises(BenchInputError, match=rf"bad.jsonl line 2: .*{message}"):
            workloads.load_jsonl(str(bad), 8)
    with pytest.raises(BenchInputError, match="cannot read dataset"):
        workloads.load_jsonl(str(tmp_path / "missing.jsonl"), 8)


# ---- metrics and thresholds -----------------------------------------------------------------------
def test_percentile_matches_linear_interpolation():
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile([10], 99) == 10
    assert metrics.percentile([5, 1, 3], 100) == 5


def test_compute_level_definitions():
    recs = [metrics.RequestRecord(start_s=0.0, end_s=1.0, token_times_s=[0.2, 0.6, 1.0], input_len=10, output_len=3),
            metrics.RequestRecord(start_s=0.5, end_s=1.5, token_times_s=[0.6, 1.0, 1.5], input_len=10, output_len=3),
            metrics.RequestRecord(start_s=0.5, end_s=0.7, error="HTTP 500")]
    lv = metrics.compute_level("enc2dec", 2, recs, duration_s=1.5)
    assert (lv.completed, lv.failed, lv.output_tokens, lv.input_tokens) == (2, 1, 6, 20)
    assert lv.out_tok_per_s == pytest.approx(4.0) and lv.total_tok_per_s == pytest.approx(26 / 1.5)
    assert lv.get("mean_ttft_ms") == pytest.approx(150.0)
    assert lv.get("mean_tpot_ms") == pytest.approx((400 + 450) / 2)
    assert lv.get("p50_itl_ms") == pytest.approx(400.0)
    assert lv.errors == ["HTTP 500"] and lv.rtf is None
    assert set(lv.to_dict()) >= {"p99_e2e_ms", "mean_itl_ms", "p90_tpot_ms", "req_per_s"}


def test_thresholds_parse_check_and_reject():
    lv = metrics.compute_level("enc2dec", 8, [metrics.RequestRecord(0.0, 1.0, [0.5, 1.0], 4, 2)], 1.0)
    ok = [thresholds.parse_threshold(t) for t in ("out_tok_per_s=2", "p99_e2e_ms<=1000", "req_per_s@8>0.5")]
    assert thresholds.check_thresholds(ok, [lv]) == []
    miss = thresholds.check_thresholds([thresholds.parse_threshold("out_tok_per_s=5000")], [lv])
    assert len(miss) == 1 and "out_tok_per_s = 2" in miss[0]
    assert "no level" in thresholds.check_thresholds([thresholds.parse_threshold("rtf@64=1")], [lv])[0]
    assert "not measured" in thresholds.check_thresholds([thresholds.parse_threshold("rtf=1")], [lv])[0]
    for bad, msg in (("tokens=5", "unknown metric"), ("out_tok_per_s", "not valid"), ("p99_e2e_ms<=fast", "not valid")):
        with pytest.raises(BenchInputError, match=msg):
            thresholds.parse_threshold(bad)


# ---- the run, on the fake engine ------------------------------------------------------------------
def test_run_bench_metrics_are_consistent(fake_llm):
    opts = session.BenchOptions(model="m", concurrency=(1, 4), num_requests=8, warmup=2, input_len=16, output_len=5)
    result = session.run_bench(opts)
    assert result.exit_code == 0 and [lv.concurrency for lv in result.levels] == [1, 4]
    llm = fake_llm[0]
    # warm-up sent but not measured: 2 requests before C=1, a wave of 4 before C=4
    assert llm.shut_down and len(llm.prompts) == (8 + 2) + (8 + 4)
    assert llm.args.kv_cache_config.cross_kv_cache_fraction == 0.5
    for lv in result.levels:
        assert lv.num_requests == lv.completed == 8 and lv.output_tokens == 8 * 5 and lv.input_tokens == 8 * 16
        for name in metrics.LATENCIES:
            s = lv.latency_ms[name]
            assert s["p50"] <= s["p90"] <= s["p99"]
        assert lv.get("p99_ttft_ms") <= lv.get("p99_e2e_ms")
        assert 0 < lv.kv_self_blocks_peak <= 2 * lv.concurrency and lv.kv_self_blocks_total == 100
    # four clients finish the same work sooner than one
    assert result.levels[1].out_tok_per_s > result.levels[0].out_tok_per_s


def test_streaming_and_duration(fake_llm):
    opts = session.BenchOptions(model="m", concurrency=(2,), duration_s=0.2, warmup=0, output_len=4, streaming=True)
    lv = session.run_bench(opts).levels[0]
    assert lv.completed >= 4 and lv.output_tokens == 4 * lv.completed
    assert lv.get("p50_itl_ms") is not None and lv.duration_s >= 0.2


def test_closed_loop_keeps_exactly_c_in_flight(fake_llm):
    from enc2dec.bench.loop import closed_loop
    from enc2dec.bench.runner import EngineTarget

    llm = FakeLLM()
    peak = 0
    target = EngineTarget(llm)

    async def send(req):
        nonlocal peak
        peak = max(peak, llm.in_flight + 1)
        return await target.send(req)

    fixed = workloads.LengthDist("fixed", 4, 0)
    reqs = workloads.synthetic_requests(3, fixed, fixed, 0, VOCAB)
    records, _ = asyncio.run(closed_loop(send, reqs, 5, 20, None))
    assert len(records) == 20 and peak == 5
