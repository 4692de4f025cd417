"""enc2dec bench's sampling options: what each request is asked to sample with, what the report
records, and the combinations refused with exit code 2."""
from __future__ import annotations

import json

import pytest
from enc2dec.cli.main import app
from fake_engine import FakeHandle, FakeLLM
from typer.testing import CliRunner

BASE = ["bench", "--quiet", "--model", "google/flan-t5-small", "--load-format", "dummy",
        "--concurrency", "1", "--num-requests", "3", "--warmup", "0", "--input-len", "4", "--output-len", "2"]


class SamplingFakeLLM(FakeLLM):
    """The fake engine, keeping each request's SamplingParams (it accepts sampled decoding)."""

    def __init__(self, args):
        super().__init__(args)
        self.params = []

    def generate_async(self, prompt, params, streaming=False):
        self.params.append(params)
        return FakeHandle(self, prompt, params, streaming)


@pytest.fixture
def sampling_llm(monkeypatch):
    made = []
    monkeypatch.setattr("enc2dec.bench.runner.start_llm", lambda args: made.append(SamplingFakeLLM(args)) or made[-1])
    return made


def test_sampling_options_reach_every_request_and_the_report(sampling_llm, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, [*BASE, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40",
                                 "--sampling-seed", "100", "--report-json", str(out)])
    assert r.exit_code == 0, r.output
    params = sampling_llm[0].params
    assert len(params) == 3 and {(p.temperature, p.top_p, p.top_k) for p in params} == {(0.7, 0.9, 40)}
    assert sorted(p.seed for p in params) == [100, 101, 102]
    assert all(p.ignore_eos and p.max_tokens == 2 and not p.is_greedy for p in params)
    rep = json.loads(out.read_text())
    assert rep["workload"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "sampling_seed": 100}


def test_a_lone_filter_samples_at_temperature_1_and_no_options_stay_greedy(sampling_llm):
    r = CliRunner().invoke(app, [*BASE, "--top-k", "5"])
    assert r.exit_code == 0, r.output
    assert all(p.top_k == 5 and p.temperature == 1.0 and p.seed is None for p in sampling_llm[0].params)
    sampling_llm.clear()
    r = CliRunner().invoke(app, BASE)
    assert r.exit_code == 0, r.output
    assert all(p.is_greedy and p.temperature == 0 for p in sampling_llm[0].params)


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "--temperature"), (["--top-p", "1.5"], "--top-p"), (["--top-k", "-2"], "--top-k"),
    (["--temperature", "0.5", "--beam-width", "2"], "--beam-width"),
    (["--top-p", "0.9", "--baseline", "hf"], "--baseline")])
def test_bad_sampling_options_exit_2_naming_the_option(sampling_llm, extra, message):
    r = CliRunner().invoke(app, [*BASE, *extra])
    assert r.exit_code == 2 and message in r.output, r.output
