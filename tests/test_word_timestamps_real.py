"""Word timestamps with the real Whisper tiny.en on LibriVox speech: words in order, inside
their segments and spelling the text, on short clips and on long audio; within 60 ms
(median) of faster-whisper's and of the transformers pipeline's word times on the same
checkpoint and clips; the CLI's json and word cues; verbose_json with word granularity
through the official openai client."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from enc2dec.cli.main import app
from enc2dec.engine import KvCacheConfig
from enc2dec.engine.whisper.transcribe import transcribe
from typer.testing import CliRunner

pytestmark = pytest.mark.real
TARGET_MS = 60                     # issue 18: median absolute difference of starts and of ends
FW_PYTHON = os.environ.get("ENC2DEC_FW_PYTHON", "/work/fw-venv/bin/python")
SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scripts" / "word_timestamps_check.py"


def _check_script():
    spec = importlib.util.spec_from_file_location("word_timestamps_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def clips(real_whisper):
    rows = [json.loads(line) for line in open(real_whisper.manifest) if line.strip()]
    return [str(real_whisper.manifest.parent / r["audio"]) for r in rows][:4]


@pytest.fixture(scope="module")
def ours(real_tiny_llm, clips):
    return transcribe(real_tiny_llm, clips, word_timestamps=True)


def _assert_well_formed(t):
    assert t.error is None and t.segments
    last = 0.0
    for s in t.segments:
        assert s.words, s
        assert "".join(w.word for w in s.words).strip() == s.text
        for w in s.words:
            assert last <= w.start_s <= w.end_s, (w, last)
            assert s.start_s <= w.start_s and w.end_s <= s.end_s <= t.duration_s + 1e-6, (w, s)
            assert 0.0 < w.probability <= 1.0
            last = w.end_s
    assert sum(w.end_s > w.start_s for s in t.segments for w in s.words) >= 0.9 * sum(len(s.words) for s in t.segments)


def test_words_are_in_order_inside_their_segments_and_spell_the_text(ours):
    for t in ours:
        _assert_well_formed(t)


@pytest.mark.parametrize("strategy", ["chunked", "sequential"])
def test_long_audio_words_stay_in_order_across_windows(real_tiny_llm, clips, tmp_path, strategy):
    waves = [sf.read(c, dtype="float32")[0] for c in clips]
    gap = np.zeros(8000, np.float32)
    path = tmp_path / "long.wav"
    sf.write(path, np.concatenate([x for w in waves * 3 for x in (w, gap)]), 16000)
    (t,) = transcribe(real_tiny_llm, [str(path)], word_timestamps=True, strategy=strategy)
    assert t.duration_s > 45
    _assert_well_formed(t)
    assert t.segments[-1].words[-1].end_s > t.duration_s - 5          # words reach the last window


def test_word_times_near_the_transformers_pipeline(real_whisper, ours, clips):
    check = _check_script()
    theirs = check.transformers_words(str(real_whisper.tiny_en), clips)
    d = check.differences_ms([[(w.word, w.start_s, w.end_s) for s in t.segments for w in s.words] for t in ours],
                             theirs)
    assert d["num_paired"] >= 0.9 * d["num_words"], d
    assert d["start_ms"] <= TARGET_MS and d["end_ms"] <= TARGET_MS, d


def test_word_times_near_faster_whisper(real_whisper, ours, clips):
    ct2 = Path(real_whisper.tiny_en).parent / "ct2-whisper-tiny.en"
    if not os.path.exists(FW_PYTHON) or not (ct2 / "model.bin").exists():
        pytest.skip(f"faster-whisper needs its own interpreter ({FW_PYTHON}, ENC2DEC_FW_PYTHON) and {ct2}")
    if subprocess.run([FW_PYTHON, "-c", "import faster_whisper"], capture_output=True).returncode != 0:
        pytest.skip(f"{FW_PYTHON} cannot import faster_whisper")
    check = _check_script()
    theirs = check.faster_whisper_subprocess(FW_PYTHON, str(ct2), clips)
    d = check.differences_ms([[(w.word, w.start_s, w.end_s) for s in t.segments for w in s.words] for t in ours],
                             theirs)
    assert d["num_paired"] >= 0.9 * d["num_words"], d
    assert d["start_ms"] <= TARGET_MS and d["end_ms"] <= TARGET_MS, d


def test_cli_json_words_and_one_cue_per_word(real_whisper, clips, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["transcribe", clips[0], "--model", str(real_whisper.tiny_en), "--quiet",
                                 "--subtitle-words", "-f", "json,srt", "-o", str(out)])
    assert r.exit_code == 0, r.output
    stem = Path(clips[0]).stem
    data = json.loads((out / f"{stem}.json").read_text())
    words = [w for s in data["segments"] for w in s["words"]]
    assert len(words) >= 10 and all(set(w) == {"word", "start", "end", "probability"} for w in words)
    assert "".join(w["word"] for w in words).strip() == data["text"]
    cues = (out / f"{stem}.srt").read_text().strip().split("\n\n")
    assert [c.split("\n")[2] for c in cues] == [w["word"].strip() for w in words]


def test_verbose_json_word_granularity_through_the_openai_client(real_whisper, clips):
    openai = pytest.importorskip("openai")
    from test_serve_helpers import LiveServer, ServeConfig, tiny_llm_factory

    cfg = ServeConfig(model=str(real_whisper.tiny_en), served_model_names=("whisper-1",))
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, max_cpu_memory_bytes=256 << 20)     # 1500 positions each
    srv = LiveServer(cfg, tiny_llm_factory(str(real_whisper.tiny_en), max_input_len=1500, max_num_tokens=4096,
                                           max_batch_size=8, kv_cache_config=kv)).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        audio = Path(clips[0]).read_bytes()
        words_only = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio),
                                                        response_format="verbose_json",
                                                        timestamp_granularities=["word"])
        words = words_only.words
        assert len(words) >= 10 and not words_only.segments
        assert "".join(w.word for w in words) == words_only.text.replace(" ", "")
        assert all(0 <= a.start <= a.end <= b.start <= b.end <= words_only.duration + 0.01
                   for a, b in zip(words, words[1:]))
        both = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio),
                                                  response_format="verbose_json",
                                                  timestamp_granularities=["word", "segment"])
        assert [w.word for w in both.words] == [w.word for w in words] and both.segments
        assert both.segments[0].start == words[0].start and both.segments[-1].end == words[-1].end
        with pytest.raises(openai.BadRequestError, match="verbose_json"):
            client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio), response_format="json",
                                               timestamp_granularities=["word"])
    finally:
        srv.stop()
