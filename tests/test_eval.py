"""enc2dec eval on tiny random checkpoints: parity 1.0 with transformers in float32 for every
family and task, bad rows counted, exit codes (0 ok, 1 a threshold missed, 2 bad usage or data)."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from enc2dec.cli.main import app
from typer.testing import CliRunner

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "machine translation is fun",
    "un chat noir dort sur le canapé et rêve de souris",
    "Numbers like 1234 and 56.78 appear too!",
    "owning a dog is good",
    "a b c d e f g h i j k l m n o p",
]


def eval_cli(*args):
    return CliRunner().invoke(app, ["eval", "--quiet", "--warmup", "0", *args])


def flat(text: str) -> str:
    """CLI output without Rich's box borders and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


@pytest.fixture
def text_data(tmp_path):
    return write_jsonl(tmp_path / "data.jsonl", [{"source": s, "target": s.upper()[:20]} for s in SENTENCES])


# Different input lengths in batches of 3: transformers pads, and parity must still be exact.
@pytest.mark.parametrize("family,task", [("t5_relu", "translation"), ("flan_t5", "summarization"),
                                         ("bart", "summarization"), ("mbart", "translation")])
def test_text_eval_matches_transformers_exactly(family, task, request, text_data, tmp_path):
    model = request.getfixturevalue(family)
    out = tmp_path / "report.json"
    rows_out = tmp_path / "rows.jsonl"
    r = eval_cli("--task", task, "--model", model, "--data", text_data, "--max-tokens", "12", "--batch-size", "3",
                 "--prefix", "summarize: ", "--min-parity", "1.0", "--report-json", str(out),
                 "--save-outputs", str(rows_out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    p = rep["parity"]
    assert p["exact_match"] == 1.0 and p["num_compared"] == len(SENTENCES) and p["first_diff_min"] is None
    assert rep["engine"]["dtype"] == "float32" and rep["exit_code"] == 0
    figures = {"translation": {"bleu", "chrf"}, "summarization": {"rouge1", "rouge2", "rougeL", "rougeLsum"}}[task]
    assert set(rep["metrics"]["enc2dec"]) == figures == set(rep["metrics"]["hf"])
    assert rep["metrics"]["enc2dec"] == rep["metrics"]["hf"]      # same ids, same text, same scores
    assert rep["timing"]["enc2dec_s"] > 0 and rep["timing"]["speedup"] > 0
    assert rep["command"].startswith(f"enc2dec eval --task {task} --model {model}")
    assert rep["decoding"]["prefix"] == "summarize: " and rep["checks"][0]["passed"] is True
    rows = [json.loads(line) for line in rows_out.read_text().splitlines()]
    assert len(rows) == len(SENTENCES) and all(row["match"] for row in rows)
    assert all(row["enc2dec_token_ids"] == row["hf_token_ids"] for row in rows)
    if family == "bart":      # the checkpoint's forced EOS is switched off, and the user is told
        assert any("forced_eos_token_id=2" in n for n in rep["decoding"]["notes"])
    assert "exact match (token ids)" in r.output and "100.00 % (7/7)" in r.output


def test_bad_rows_are_counted_not_fatal(t5_relu, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"source": "hello world", "target": "hallo"},
        {"source": "", "target": "leer"},                   # empty source
        {"source": "no reference here"},                   # missing field
        {"source": 42, "target": "a number"},              # not text
        {"source": "the lazy dog", "target": "der Hund"},
        {"source": SENTENCES[-1] * 3, "target": "too long for max_input_len"},
    ], extra_lines=["{not json"])
    config = tmp_path / "engine.yaml"       # no cross_kv_cache_fraction: eval uses 0.5
    config.write_text("max_batch_size: 4\nmax_input_len: 24\nkv_cache_config:\n  tokens_per_block: 8\n")
    out = tmp_path / "r.json"
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", data, "--reference", "none",
                 "--config", str(config), "--max-tokens", "6", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    d = rep["data"]
    assert (d["num_rows"], d["num_used"], d["num_bad"]) == (7, 2, 5)
    assert d["bad_by_kind"] == {"empty text": 1, "missing field": 1, "not text": 1, "not JSON": 1,
                                "rejected by the engine": 1}
    assert [b["row"] for b in d["bad_rows"]] == [1, 2, 3, 5, 6]
    assert "max_input_len=24" in d["bad_rows"][3]["detail"]
    assert rep["engine"]["max_batch_size"] == 4 and rep["parity"] is None and rep["metrics"]["hf"] is None
    assert "2 used, 5 bad" in r.output


def test_dataset_folder_saved_with_datasets(t5_relu, tmp_path, monkeypatch):
    # A folder written by datasets' save_to_disk (one split, no DatasetDict) is read with
    # load_from_disk: its rows reach both sides, and without the package it is a usage error.
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"source": SENTENCES[:3], "target": [s.upper() for s in SENTENCES[:3]]}) \
        .save_to_disk(str(folder))
    out = tmp_path / "r.json"
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", str(folder), "--max-tokens", "5",
                 "--min-parity", "1.0", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert (rep["data"]["num_rows"], rep["data"]["num_used"]) == (3, 3)
    assert rep["parity"]["exact_match"] == 1.0 and rep["parity"]["num_compared"] == 3
    monkeypatch.setitem(sys.modules, "datasets", None)
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", str(folder))
    assert r.exit_code == 2 and "needs the 'datasets' package" in r.output


def test_limit_counts_bad_rows_too(t5_relu, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"source": "x"}] + [{"source": s, "target": s} for s in SENTENCES])
    out = tmp_path / "r.json"
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", data, "--reference", "none",
                 "--max-tokens", "4", "--limit", "3", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())["data"]
    assert (d["num_rows"], d["num_used"], d["num_bad"]) == (3, 2, 1)


def test_all_bad_rows_exit_2_and_name_the_fields(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"de": s, "en": s} for s in SENTENCES[:3]])
    r = eval_cli("--task", "translation", "--model", "unused", "--data", data)
    assert r.exit_code == 2
    assert "all 3 rows" in r.output and "missing field" in r.output and "de, en" in r.output
    assert "Traceback" not in r.output


def test_missed_threshold_exits_1(t5_relu, text_data, tmp_path):
    out = tmp_path / "r.json"
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", text_data, "--reference", "none",
                 "--max-tokens", "4", "--min-bleu", "99", "--report-json", str(out))
    assert r.exit_code == 1, r.output
    assert "CHECK FAILED: --min-bleu 99" in r.output
    rep = json.loads(out.read_text())
    assert rep["exit_code"] == 1 and rep["checks"] == [
        {"option": "--min-bleu", "figure": "bleu", "value": rep["metrics"]["enc2dec"]["bleu"], "limit": 99.0,
         "passed": False}]


@pytest.mark.parametrize("args,message", [
    (["--task", "translation", "--num-beams", "0"], "--num-beams must be >= 1"),
    (["--task", "poetry"], "--task 'poetry' is not valid; valid: translation, summarization"),
    (["--task", "translation", "--max-wer", "0.1"], "--max-wer does not apply to --task translation"),
    (["--task", "transcription", "--min-rouge", "10"], "--min-rouge does not apply to --task transcription"),
    (["--task", "translation", "--reference", "none", "--min-parity", "1"], "--min-parity needs --reference hf"),
    (["--task", "translation", "--reference", "vllm"], "--reference 'vllm' is not valid; valid: hf, none"),
    (["--task", "translation", "--limit", "0"], "--limit must be >= 1"),
    (["--task", "translation", "--min-parity", "2"], "--min-parity is a fraction"),
    (["--task", "speech-translation"], "needs --language"),
    (["--task", "transcription", "--prefix", "x"], "--prefix applies to text tasks"),
    (["--task", "translation", "--language", "de"], "--language applies to the Whisper tasks"),
    (["--task", "translation", "--load-format", "dummy"], "use --reference none with dummy weights"),
    (["--task", "translation", "--data", "nowhere.jsonl"], "nowhere.jsonl: no such file"),
    (["--task", "translation", "--dtype", "fp8", "--data", "DATA"], "dtype='fp8' is not valid"),
    (["--task", "translation", "--limit", "many"], "Invalid value for '--limit'"),
])
def test_bad_usage_exits_2(args, message, text_data):
    args = [text_data if a == "DATA" else a for a in args]
    r = eval_cli("--model", "unused", *args)
    assert r.exit_code == 2, r.output
    assert message in flat(r.output)
    assert "Traceback" not in r.output


def test_wrong_model_family_for_task_exits_2(t5_relu, tmp_path):
    data = write_jsonl(tmp_path / "m.jsonl", [{"audio": "a.wav", "text": "hi"}])
    import soundfile

    soundfile.write(tmp_path / "a.wav", np.zeros(1600, np.float32), 16000)
    r = eval_cli("--task", "transcription", "--model", t5_relu, "--data", data)
    assert r.exit_code == 2 and "needs a Whisper checkpoint" in r.output


def test_default_dataset_without_the_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    r = eval_cli("--task", "summarization", "--model", "unused", "--limit", "2")
    assert r.exit_code == 2, r.output
    assert "cnn_dailymail" in r.output and "Traceback" not in r.output


def test_unreadable_file_exits_2(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"source": "Grüße", "target": "hi"}\n'.encode("latin-1"))
    r = eval_cli("--task", "translation", "--model", "unused", "--data", str(path))
    assert r.exit_code == 2 and "UnicodeDecodeError" in flat(r.output) and "Traceback" not in r.output


def test_num_beams_runs_beam_search_on_both_sides(t5_relu, text_data, tmp_path, monkeypatch):
    from enc2dec.engine import LLM
    from enc2dec.eval import hf_reference

    seen = {}
    submit, hf_generate = LLM.generate_async, hf_reference.HfReference._generate

    def spy(self, prompt, params=None, streaming=False):
        seen["engine"] = (self.args.max_beam_width, params)
        return submit(self, prompt, params, streaming)

    def hf_spy(self, items):
        seen["hf"] = self.generation_config.num_beams
        return hf_generate(self, items)

    monkeypatch.setattr(LLM, "generate_async", spy)
    monkeypatch.setattr(hf_reference.HfReference, "_generate", hf_spy)
    out = tmp_path / "report.json"
    r = eval_cli("--task", "translation", "--model", t5_relu, "--data", text_data, "--max-tokens", "10",
                 "--batch-size", "1", "--num-beams", "3", "--min-parity", "1.0", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    width, params = seen["engine"]
    assert width == 3 and params.use_beam_search and params.best_of == 3 and params.n == 1
    assert seen["hf"] == 3
    rep = json.loads(out.read_text())
    assert rep["decoding"]["num_beams"] == 3 and rep["parity"]["exact_match"] == 1.0
