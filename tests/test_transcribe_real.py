"""enc2dec transcribe with the real Whisper tiny.en and base checkpoints on LibriVox speech:
transcripts equal transformers' greedy ones, long audio within 10% WER with both strategies,
any rate and channel count, subtitle files that parse, a corrupt file among good ones.

WER normalisation: transformers' EnglishTextNormalizer (Whisper's English normaliser) with
the checkpoint's normalizer.json spelling map when the folder has one; the converted folders
of real_models.py have none, so it runs with an empty map (numbers, contractions, titles
and punctuation are still normalised; only British/American spellings are not unified)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import soundfile as sf
from enc2dec.cli.main import app
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.whisper.transcribe import transcribe
from enc2dec.engine.whisper.rules import TimestampRules
from enc2dec.engine.whisper.tokens import engine_whisper_info
from hf_reference import hf_whisper
from typer.testing import CliRunner

pytestmark = pytest.mark.real
SILENCE_S = 0.8


def _rows(real):
    return [json.loads(line) for line in open(real.manifest)]


def _clip(real, row):
    wave, rate = sf.read(str(real.manifest.parent / row["audio"]), dtype="float32")
    assert rate == 16000
    return wave


@pytest.fixture(scope="module")
def base_llm(real_whisper):
    with LLM(str(real_whisper.base), kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        yield llm


@pytest.fixture(scope="module")
def joined(real_whisper, tmp_path_factory):
    """Every clip twice, 0.8 s of silence after each: 64.6 s, with the references in order."""
    parts, refs = [], []
    for _ in range(2):
        for row in _rows(real_whisper):
            parts += [_clip(real_whisper, row), np.zeros(int(SILENCE_S * 16000), np.float32)]
            refs.append(row["text"])
    path = tmp_path_factory.mktemp("long") / "joined.wav"
    sf.write(path, np.concatenate(parts), 16000)
    return path, " ".join(refs)


def _normalizer(ckpt):
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spelling = os.path.join(ckpt, "normalizer.json")
    return EnglishTextNormalizer(json.load(open(spelling)) if os.path.exists(spelling) else {})


@pytest.mark.parametrize("name", ["tiny_en", "base"])
def test_each_clip_equals_transformers_greedy(real_whisper, name, request):
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    ckpt = getattr(real_whisper, name)
    llm = request.getfixturevalue("real_tiny_llm" if name == "tiny_en" else "base_llm")
    rows = _rows(real_whisper)
    files = [str(real_whisper.manifest.parent / r["audio"]) for r in rows]
    results = transcribe(llm, files)        # base: the language is detected
    hf, fe, tok = hf_whisper(ckpt), WhisperFeatureExtractor.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    # transformers detects the language too when given only the task (multilingual checkpoints).
    kw = {"task": "transcribe"} if hf.generation_config.is_multilingual else {}
    for row, t in zip(rows, results):
        feats = fe(_clip(real_whisper, row), sampling_rate=16000, return_tensors="pt").input_features
        ref = tok.batch_decode(hf.generate(feats, **kw), skip_special_tokens=True)[0].strip()
        assert t.error is None and t.language == "en"
        assert t.text == ref, row["audio"]


def test_timestamp_tokens_equal_transformers(real_whisper, real_tiny_llm):
    """The timestamp rules as a logits processor give transformers' return_timestamps tokens."""
    from transformers import WhisperFeatureExtractor

    hf = hf_whisper(real_whisper.tiny_en)
    hf.generation_config.max_initial_timestamp_index = 50
    fe = WhisperFeatureExtractor.from_pretrained(real_whisper.tiny_en)
    tok = engine_whisper_info(real_tiny_llm)[0]
    rules = TimestampRules(0, tok.eot, tok.no_timestamps, tok.timestamp_begin, 50)
    for row in _rows(real_whisper)[:3]:
        wave = _clip(real_whisper, row)
        out = real_tiny_llm.generate({"prompt": "<|startoftranscript|>", "multi_modal_data": {"audio": [(wave, 16000)]}},
                                SamplingParams(max_tokens=100, temperature=0.0, logits_processors=[rules]))
        feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features
        ref = hf.generate(feats, return_timestamps=True).tolist()[0]
        ref = ref[ref.index(tok.sot) + 1:] if tok.sot in ref else ref
        got = out.outputs[0].token_ids
        assert got[:-1] == ref and got[-1] == tok.eot, row["audio"]
        assert got[0] >= tok.timestamp_begin and got[-2] >= tok.timestamp_begin


@pytest.mark.parametrize("strategy", ["sequential", "chunked", "vad"])
def test_long_audio_wer_and_segments(real_whisper, base_llm, joined, strategy):
    import jiwer

    path, reference = joined
    duration = sf.info(str(path)).duration
    assert duration >= 60
    t, = transcribe(base_llm, [str(path)], strategy=strategy, timestamps=True)
    norm = _normalizer(real_whisper.base)
    wer = jiwer.wer(norm(reference), norm(t.text))
    print(f"\n{strategy} whisper-base WER {wer:.4f} on {duration:.1f} s, {t.num_windows} windows")
    assert wer <= 0.10, t.text
    assert t.language == "en" and t.duration_s == pytest.approx(duration)
    times = [x for s in t.segments for x in (s.start_s, s.end_s)]
    assert times == sorted(times) and times[0] >= 0 and times[-1] <= duration
    assert len(t.segments) >= 10 and all(s.text for s in t.segments)
    # Each segment carries the measures of the window it came from, several windows here.
    assert all(s.avg_logprob < 0 and s.compression_ratio > 0 for s in t.segments), t.segments
    assert len({(s.avg_logprob, s.compression_ratio) for s in t.segments}) > 1 and t.num_windows > 1


def test_44k_stereo_equals_16k_mono(real_whisper, real_tiny_llm, tmp_path):
    import soxr

    row = _rows(real_whisper)[0]
    mono = _clip(real_whisper, row)
    hi = soxr.resample(mono, 16000, 44100)
    path = tmp_path / "stereo44k.flac"
    sf.write(path, np.stack([hi, hi], axis=1), 44100)
    assert sf.info(str(path)).channels == 2 and sf.info(str(path)).samplerate == 44100
    a, b = transcribe(real_tiny_llm, [str(real_whisper.manifest.parent / row["audio"]), str(path)])
    assert a.error is None and b.error is None and a.text == b.text and a.text


def _cues(text, decimal):
    stamp = rf"(\d\d):(\d\d):(\d\d){decimal}(\d\d\d)"
    spans = re.findall(rf"^{stamp} --> {stamp}$", text, flags=re.MULTILINE)
    return [(int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000, int(h2) * 3600 + int(m2) * 60 + int(s2)
             + int(ms2) / 1000) for h, m, s, ms, h2, m2, s2, ms2 in spans]


def test_cli_subtitles_json_and_a_corrupt_file(real_whisper, joined, tmp_path):
    path, _ = joined
    corrupt = tmp_path / "broken.mp3"
    corrupt.write_bytes(os.urandom(4096))
    clip = real_whisper.manifest.parent / _rows(real_whisper)[1]["audio"]
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["transcribe", str(path), str(corrupt), str(clip), "--model",
                                 str(real_whisper.tiny_en), "-f", "all", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert re.search(r"error: cannot read .*broken\.mp3", r.stderr) and "Traceback" not in r.output
    assert "transcribed 2 of 3 files (1 failed)" in r.stderr and "real time" in r.stderr
    duration = sf.info(str(path)).duration
    srt = (out / "joined.srt").read_text()
    blocks = [b for b in srt.strip().split("\n\n") if b]
    assert [b.split("\n")[0] for b in blocks] == [str(i) for i in range(1, len(blocks) + 1)]
    for cues in (_cues(srt, ","), _cues((out / "joined.vtt").read_text(), r"\.")):
        assert len(cues) == len(blocks) >= 10
        flat = [x for c in cues for x in c]
        assert flat == sorted(flat) and flat[-1] <= duration + 1e-3
    assert (out / "joined.vtt").read_text().startswith("WEBVTT\n\n")
    data = json.loads((out / "joined.json").read_text())
    assert data["language"] == "en" and data["duration_s"] == pytest.approx(duration, abs=1e-3)
    assert len(data["segments"]) == len(blocks) and {"start", "end", "text"} <= set(data["segments"][0])
    assert (out / "joined.tsv").read_text().startswith("start\tend\ttext\n")
    assert "young man" in (out / f"{clip.stem}.txt").read_text()
    assert not list(out.glob("broken*"))
