"""enc2dec bench end to end on tiny random checkpoints (CPU): the engine, the HF baseline, audio.

Each tiny model is a config.json in a tmp folder benched with load_format=dummy, so no
weights or tokenizer files are involved.
"""
from __future__ import annotations

import csv
import json

import pytest
from enc2dec.cli.main import app
from typer.testing import CliRunner

LATENCIES = ("ttft", "tpot", "itl", "e2e")


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    from transformers import T5Config

    folder = tmp_path_factory.mktemp("tiny_t5")
    T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=512, decoder_start_token_id=0,
             eos_token_id=1, pad_token_id=0, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    from transformers import WhisperConfig

    folder = tmp_path_factory.mktemp("tiny_whisper")
    WhisperConfig(vocab_size=600, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                  max_source_positions=1500, max_target_positions=448, decoder_start_token_id=1, eos_token_id=2,
                  pad_token_id=2, bos_token_id=2, begin_suppress_tokens=None,
                  suppress_tokens=None).save_pretrained(folder)
    return str(folder)


def run(*args):
    r = CliRunner().invoke(app, ["bench", "--quiet", "--load-format", "dummy", *args])
    return r


def check_consistent(lv: dict, n: int, out_len: int | None = None):
    """What every level record must satisfy, whatever the backend."""
    assert lv["completed"] == lv["num_requests"] == n and lv["failed"] == 0, lv["errors"]
    if out_len is not None:
        assert lv["output_tokens"] == n * out_len
    assert lv["out_tok_per_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
    assert lv["total_tok_per_s"] == pytest.approx((lv["input_tokens"] + lv["output_tokens"]) / lv["duration_s"])
    assert lv["req_per_s"] == pytest.approx(n / lv["duration_s"])
    for m in LATENCIES:
        values = [lv[f"{s}_{m}_ms"] for s in ("p50", "p90", "p99")]
        assert all(v is not None and v >= 0 for v in values), m
        assert values == sorted(values), m
        assert lv[f"mean_{m}_ms"] is not None
    for s in ("mean", "p50", "p99"):
        assert lv[f"{s}_ttft_ms"] <= lv[f"{s}_e2e_ms"]
    assert lv["mean_tpot_ms"] <= lv["mean_e2e_ms"]


def test_t5_engine_and_hf_baseline(tiny_t5, tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    r = run("--model", tiny_t5, "--concurrency", "1,3", "--num-requests", "6", "--input-len", "16",
            "--input-dist", "uniform:6", "--output-len", "8", "--baseline", "hf", "--report-json", str(out),
            "--csv", str(table))
    assert r.exit_code == 0, r.output
    assert "enc2dec vs baselines" in r.output
    rep = json.loads(out.read_text())
    assert rep["dtype"] == "float32" and rep["device"]["type"] == "cpu" and rep["baseline_dtype"] == "float32"
    assert rep["engine_args"]["kv_cache_config"]["cross_kv_cache_fraction"] == 0.5
    levels = {(lv["backend"], lv["concurrency"]): lv for lv in rep["levels"]}
    assert set(levels) == {("enc2dec", 1), ("hf", 1), ("enc2dec", 3), ("hf", 3)}
    for (_, c), lv in levels.items():
        check_consistent(lv, 6, 8)
        # same requests on both sides: the same encoder tokens
        assert lv["input_tokens"] == levels[("enc2dec", c)]["input_tokens"]
    for c in (1, 3):
        ours = levels[("enc2dec", c)]
        assert 0 < ours["kv_self_blocks_peak"] <= ours["kv_self_blocks_total"]
        assert 0 < ours["kv_cross_blocks_peak"] <= ours["kv_cross_blocks_total"]
        # The engine's own steps over the level: every output token came from a launched row,
        # and no step held more rows than requests in flight.
        assert ours["engine_steps"] > 0 and 0 < ours["engine_rows_per_step"] <= c
        assert ours["engine_steps"] * ours["engine_rows_per_step"] >= ours["output_tokens"]
        assert ours["engine_step_ms"] > 0 and 0 <= ours["engine_device_wait_frac"] <= 1
        # A request's time in the engine lies inside the time the client waited for it.
        assert 0 < ours["engine_ttft_ms"] <= ours["mean_ttft_ms"]
        assert ours["engine_ttft_ms"] <= ours["engine_e2e_ms"] <= ours["mean_e2e_ms"]
        assert levels[("hf", c)]["engine_steps"] is None and levels[("hf", c)]["engine_e2e_ms"] is None
    assert {(x["concurrency"], x["baseline"]) for x in rep["ratios"]} == {(1, "hf"), (3, "hf")}
    ratio = rep["ratios"][0]
    assert ratio["out_tok_per_s"] == pytest.approx(levels[("enc2dec", 1)]["out_tok_per_s"] /
                                                   levels[("hf", 1)]["out_tok_per_s"])
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 4 and rows[0]["backend"] == "enc2dec" and float(rows[0]["p99_e2e_ms"]) > 0


def test_whisper_synthetic_audio_and_rtf(tiny_whisper, tmp_path):
    out = tmp_path / "r.json"
    r = run("--model", tiny_whisper, "--concurrency", "2", "--num-requests", "4", "--warmup", "1",
            "--audio-seconds", "2", "--output-len", "6", "--baseline", "hf", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["workload"]["kind"] == "audio-synthetic" and rep["workload"]["audio_seconds"] == 2
    for lv in rep["levels"]:
        check_consistent(lv, 4, 6)
        assert lv["input_tokens"] == 0 and lv["audio_s"] == pytest.approx(8.0)
        assert lv["rtf"] == pytest.approx(8.0 / lv["duration_s"])
    assert rep["ratios"][0]["rtf"] is not None
    # what tuning's auto admission resolved to (0 in engine_args): one clip a decoding step on the CPU
    assert rep["engine_args"]["tuning"]["encoder_tokens_while_decoding"] == 0
    limits = rep["engine_limits"]
    assert limits["encoder_max_num_tokens_while_decoding"] == 1500 and limits["defer_joins_while_decoding"] == 0


def test_streaming_dataset_rows_and_missed_threshold(tiny_t5, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [5, 6, 7, 8], "output_tokens": 3}\n'
                    '{"input_ids": [9, 10], "output_tokens": 5}\n'
                    '{"input_ids": [11, 12, 13], "output_tokens": 2}\n')
    out = tmp_path / "r.json"
    r = run("--model", tiny_t5, "--concurrency", "2", "--num-requests", "4", "--warmup", "0", "--streaming",
            "--dataset", str(data), "--report-json", str(out), "--fail-under", "p99_e2e_ms<=0.001")
    assert r.exit_code == 1 and "FAIL-UNDER" in r.output
    lv = json.loads(out.read_text())["levels"][0]
    check_consistent(lv, 4)
    # rows replayed in order, cycling: 3 + 5 + 2 + 3 outputs, 4 + 2 + 3 + 4 inputs
    assert lv["output_tokens"] == 13 and lv["input_tokens"] == 13
    assert json.loads(out.read_text())["exit_code"] == 1


def test_whisper_model_rejects_text_workload(tiny_whisper, tiny_t5):
    r = run("--model", tiny_whisper, "--concurrency", "1", "--input-len", "8")
    assert r.exit_code == 2 and "Whisper model" in r.output
    r = run("--model", tiny_t5, "--concurrency", "1", "--audio-seconds", "3")
    assert r.exit_code == 2 and "need a Whisper model" in r.output


def test_readme_command_on_a_known_dummy_model():
    r = run("--model", "google/flan-t5-small", "--concurrency", "1,2", "--num-requests", "2", "--warmup", "0",
            "--input-len", "8", "--output-len", "4")
    assert r.exit_code == 0, r.output
    assert "google/flan-t5-small" in r.output


@pytest.mark.gpu
def test_hf_compile_baseline_on_gpu(tiny_t5, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "r.json"
    r = run("--model", tiny_t5, "--dtype", "bfloat16", "--concurrency", "2,4", "--num-requests", "8",
            "--output-len", "8", "--baseline", "hf,hf-compile", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert {lv["backend"] for lv in rep["levels"]} == {"enc2dec", "hf", "hf-compile"}
    for lv in rep["levels"]:
        check_consistent(lv, 8, 8)
        assert lv["peak_gpu_mem_gib"] > 0


def test_hf_compile_on_cpu_is_a_clear_usage_error(tiny_t5):
    r = run("--model", tiny_t5, "--device", "cpu", "--concurrency", "1", "--num-requests", "1",
            "--output-len", "2", "--baseline", "hf-compile")
    assert r.exit_code == 2 and "CUDA" in r.output
