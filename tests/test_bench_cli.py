"""enc2dec bench's command line against the fake engine of test_bench_unit: options, reports,
exit codes (0 ok, 1 a check missed or a request failed, 2 bad usage or input)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from enc2dec.bench import session
from enc2dec.cli.main import app
from fake_engine import FakeLLM
from typer.testing import CliRunner


def bench_cli(*args):
    return CliRunner().invoke(app, ["bench", "--quiet", *args])


BASE = ["--model", "google/flan-t5-small", "--load-format", "dummy"]


def test_cli_ok_json_csv_and_schema(fake_llm, tmp_path):
    out, csv_path = tmp_path / "r.json", tmp_path / "r.csv"
    r = bench_cli(*BASE, "--concurrency", "1,2", "--num-requests", "4", "--input-len", "8", "--output-len", "3",
                  "--report-json", str(out), "--csv", str(csv_path), "--fail-under", "out_tok_per_s=1")
    assert r.exit_code == 0, r.output
    assert "out tok/s" in r.output
    rep = json.loads(out.read_text())
    assert rep["schema"] == "enc2dec.bench/v1" and rep["exit_code"] == 0
    assert {"command", "versions", "device", "model", "dtype", "workload", "engine_args", "levels", "ratios",
            "complete", "concurrency", "num_requests"} <= set(rep) and rep["complete"] is True
    assert rep["command"] == ("enc2dec bench --model google/flan-t5-small --load-format dummy --concurrency 1,2 "
                              f"--num-requests 4 --input-len 8 --output-len 3 --report-json {out} --csv {csv_path} "
                              "--fail-under out_tok_per_s=1 --quiet")
    assert set(rep["versions"]) >= {"enc2dec", "torch", "transformers"}
    assert [lv["concurrency"] for lv in rep["levels"]] == [1, 2]
    assert all(lv["output_tokens"] == 4 * 3 for lv in rep["levels"])
    assert csv_path.read_text().splitlines()[0].startswith("backend,concurrency")


def test_cli_exit_1_on_missed_threshold_and_failed_request(fake_llm, tmp_path):
    r = bench_cli(*BASE, "--concurrency", "1", "--num-requests", "2", "--output-len", "2",
                  "--fail-under", "out_tok_per_s=1e9")
    assert r.exit_code == 1 and "FAIL-UNDER" in r.output
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [13, 5], "output_tokens": 2}\n{"input_ids": [4, 5], "output_tokens": 2}\n')
    r = bench_cli(*BASE, "--concurrency", "1", "--num-requests", "2", "--warmup", "0", "--dataset", str(data))
    assert r.exit_code == 1 and "FAILED" in r.output and "boom" in r.output


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--fail-under", "speed=3"], "unknown metric"),
    (["--baseline", "vllm"], "--baseline"),
    (["--input-dist", "zipf"], "--input-dist"),
    (["--num-requests", "0"], "--num-requests"),
    (["--audio-seconds", "10", "--dataset", "x.jsonl"], "one workload source|--audio-seconds"),
])
def test_cli_usage_errors_exit_2(fake_llm, args, message):
    r = bench_cli(*BASE, *args)
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and re.search(message, r.output) and "Traceback" not in r.output


def test_cli_bad_dataset_row_and_out_of_vocab_ids_exit_2(fake_llm, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2], "output_tokens": 2}\n{"input_ids": "abc", "output_tokens": 2}\n')
    r = bench_cli(*BASE, "--concurrency", "1", "--dataset", str(data))
    assert r.exit_code == 2 and "d.jsonl line 2" in r.output
    data.write_text('{"input_ids": [1, 99999], "output_tokens": 2}\n')
    r = bench_cli(*BASE, "--concurrency", "1", "--num-requests", "1", "--dataset", str(data))
    assert r.exit_code == 2 and "d.jsonl line 1" in r.output and "vocabulary" in r.output


def test_cli_text_prompts_need_a_tokenizer(fake_llm, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "summarize: hi", "output_tokens": 2}\n')
    r = bench_cli(*BASE, "--concurrency", "1", "--dataset", str(data))
    assert r.exit_code == 2 and "tokenizer" in r.output


def test_cli_plot_and_missing_matplotlib(fake_llm, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    r = bench_cli(*BASE, "--concurrency", "1,2", "--num-requests", "2", "--output-len", "2", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = bench_cli(*BASE, "--concurrency", "1", "--plot", str(png))
    assert r.exit_code == 2 and "matplotlib" in r.output and not fake_llm[1:]   # failed before starting


def test_engine_config_yaml_and_errors(fake_llm, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_batch_size: 4\nkv_cache_config:\n  cross_kv_cache_fraction: 0.3\n")
    r = bench_cli(*BASE, "--config", str(cfg), "--concurrency", "1", "--num-requests", "1", "--output-len", "2",
                  "--free-gpu-memory-fraction", "0.7")
    assert r.exit_code == 0, r.output
    args = fake_llm[-1].args
    assert args.max_batch_size == 4 and args.kv_cache_config.cross_kv_cache_fraction == 0.3
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.7
    cfg.write_text("max_batch_sise: 4\n")
    r = bench_cli(*BASE, "--config", str(cfg), "--concurrency", "1")
    assert r.exit_code == 2 and "max_batch_sise" in r.output and "max_batch_size" in r.output


def test_num_requests_per_level(fake_llm):
    r = bench_cli(*BASE, "--concurrency", "1,2", "--num-requests", "3,5", "--output-len", "2", "--warmup", "0")
    assert r.exit_code == 0, r.output
    assert len(fake_llm[0].prompts) == 3 + 5
    r = bench_cli(*BASE, "--concurrency", "1,2,4", "--num-requests", "3,5")
    assert r.exit_code == 2 and "one per level" in r.output


def test_partial_report_survives_a_crash(fake_llm, tmp_path, monkeypatch):
    def boom(self, *args):
        raise RuntimeError("baseline exploded")

    monkeypatch.setattr(session._Run, "_run_baselines", boom)
    out = tmp_path / "r.json"
    r = bench_cli(*BASE, "--concurrency", "1,2", "--num-requests", "2", "--output-len", "2", "--report-json", str(out))
    assert r.exit_code == 1 and "bench failed: RuntimeError: baseline exploded" in r.output
    assert "Traceback" not in r.output
    rep = json.loads(out.read_text())
    assert rep["complete"] is False and [lv["concurrency"] for lv in rep["levels"]] == [1, 2]


def test_hf_dataset_fields(fake_llm, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"q": [[5, 6, 7], [8, 9]], "n": [3, 4]}).save_to_disk(str(path))
    out = tmp_path / "r.json"
    r = bench_cli(*BASE, "--concurrency", "1", "--num-requests", "2", "--warmup", "0", "--hf-dataset", str(path),
                  "--hf-prompt-field", "q", "--hf-output-len-field", "n", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    lv = json.loads(out.read_text())["levels"][0]
    assert (lv["input_tokens"], lv["output_tokens"]) == (5, 7)
    r = bench_cli(*BASE, "--concurrency", "1", "--hf-dataset", str(path), "--hf-prompt-field", "question")
    assert r.exit_code == 2 and "'question' is not a column" in r.output and "columns: n, q" in r.output
    r = bench_cli(*BASE, "--concurrency", "1", "--hf-dataset", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "cannot load Hugging Face dataset" in r.output


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from enc2dec.cli.main import app; "
            "r = CliRunner().invoke(app, ['bench', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_beam_width_reaches_the_engine_and_the_baselines(fake_llm, monkeypatch, tmp_path):
    seen, widths = [], []
    submit = FakeLLM.generate_async

    def spy(self, prompt, params, streaming=False):
        seen.append(params)
        return submit(self, prompt, params, streaming)

    def no_baseline_run(self, reqs, device, dtype):      # the HF side's num_beams: see the next test
        widths.append(self.opts.beam_width)

    monkeypatch.setattr(FakeLLM, "generate_async", spy)
    monkeypatch.setattr(session._Run, "_run_baselines", no_baseline_run)
    out = tmp_path / "r.json"
    r = bench_cli(*BASE, "--concurrency", "2", "--num-requests", "2", "--output-len", "3", "--beam-width", "4",
                  "--baseline", "hf", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    args = fake_llm[0].args
    assert args.max_beam_width == 4 and args.max_batch_size >= 2 * 4
    assert seen and all(p.use_beam_search and p.best_of == 4 and p.n == 1 for p in seen)
    assert widths == [4]
    assert json.loads(out.read_text())["engine_args"]["max_beam_width"] == 4
    r = bench_cli(*BASE, "--beam-width", "0")
    assert r.exit_code == 2 and "--beam-width must be >= 1" in r.output


def test_hf_baseline_runs_num_beams(t5_relu):
    import torch
    from enc2dec.bench.hf_baseline import HfBaseline
    from enc2dec.bench.workloads import BenchRequest

    base = HfBaseline("hf", t5_relu, "auto", torch.device("cpu"), torch.float32, num_beams=3)
    assert base.generation_config.num_beams == 3
    records = base.run_batch([BenchRequest([5, 6, 7, 1], 4, 5), BenchRequest([8, 9, 1], 3, 5)])
    assert [(r.error, r.output_len) for r in records] == [(None, 5), (None, 5)]
