"""enc2dec eval's Whisper tasks on the tiny random Whisper: parity with transformers for
transcription and speech translation, audio rows that cannot be used counted as bad, and the
audio loader (paths, Hugging Face audio values, stereo, other rates, the 30 s limit)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile
from enc2dec.eval.audio import SAMPLE_RATE, AudioError, load_clip
from test_eval import eval_cli, flat, write_jsonl


def _noise(seconds: float, rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * rate)) * 0.1).astype(np.float32)


@pytest.fixture
def manifest(tmp_path):
    """Three usable clips (one at 8 kHz, resampled) and four rows that are not usable."""
    soundfile.write(tmp_path / "a.wav", _noise(3, seed=1), SAMPLE_RATE)
    soundfile.write(tmp_path / "b.flac", _noise(5, seed=2), SAMPLE_RATE)
    soundfile.write(tmp_path / "c.wav", _noise(2, 8000, seed=3), 8000)
    soundfile.write(tmp_path / "long.wav", np.zeros(31 * SAMPLE_RATE, np.float32), SAMPLE_RATE)
    (tmp_path / "junk.wav").write_text("not audio")
    return write_jsonl(tmp_path / "manifest.jsonl", [
        {"audio": "a.wav", "text": "Hello world."},
        {"audio": "b.flac", "text": "the colour grey"},
        {"audio": str(tmp_path / "c.wav"), "text": "ten meters"},       # absolute paths work too
        {"audio": "long.wav", "text": "too long"},
        {"audio": "junk.wav", "text": "unreadable"},
        {"audio": "missing.wav", "text": "no file"},
        {"audio": "a.wav", "text": " - "},                              # nothing left after normalization
    ])


def test_transcription_parity_and_bad_audio_rows(whisper, manifest, tmp_path):
    out = tmp_path / "r.json"
    r = eval_cli("--task", "transcription", "--model", whisper, "--data", manifest, "--max-tokens", "8",
                 "--min-parity", "1.0", "--max-wer", "100", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["parity"]["exact_match"] == 1.0 and rep["parity"]["num_compared"] == 3
    assert rep["data"]["bad_by_kind"] == {"audio too long": 1, "unreadable audio": 2, "empty text": 1}
    assert rep["decoding"]["whisper_prompt"] == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert set(rep["metrics"]["enc2dec"]) == {"wer", "cer"} and rep["metrics"]["enc2dec"] == rep["metrics"]["hf"]
    assert "EnglishTextNormalizer without the British-to-American spelling map" in rep["normalizer"]
    assert rep["timing"]["audio_s"] == pytest.approx(10.0)
    assert "normalizer: Whisper EnglishTextNormalizer" in flat(r.output)


def test_speech_translation_uses_the_translate_prefix(whisper, manifest, tmp_path):
    out = tmp_path / "r.json"
    r = eval_cli("--task", "speech-translation", "--language", "fr", "--model", whisper, "--data", manifest,
                 "--limit", "2", "--max-tokens", "6", "--min-parity", "1.0", "--min-bleu", "0",
                 "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["decoding"]["whisper_prompt"] == "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    assert rep["parity"]["exact_match"] == 1.0 and set(rep["metrics"]["enc2dec"]) == {"bleu", "chrf"}


def test_unknown_language_is_a_usage_error(whisper, manifest):
    r = eval_cli("--task", "speech-translation", "--language", "xx", "--model", whisper, "--data", manifest)
    assert r.exit_code == 2 and "<|xx|> is not a token of this checkpoint" in flat(r.output)


# ---- the loader ----------------------------------------------------------------------------------

def test_load_clip_accepts_every_row_shape(tmp_path):
    wave = _noise(1.5)
    soundfile.write(tmp_path / "s.wav", np.stack([wave, wave], axis=1), SAMPLE_RATE)     # stereo
    buf = io.BytesIO()
    soundfile.write(buf, wave, SAMPLE_RATE, format="WAV")
    for value in ("s.wav", {"path": str(tmp_path / "s.wav"), "bytes": None}, {"bytes": buf.getvalue()},
                  {"array": wave.astype(np.float64), "sampling_rate": SAMPLE_RATE}):
        got = load_clip(value, str(tmp_path))
        assert got.dtype == np.float32 and got.shape == wave.shape
        np.testing.assert_allclose(got, wave, atol=1e-4)


def test_load_clip_resamples_to_16k():
    t = np.arange(22050) / 22050
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)             # 1 s of 440 Hz at 22.05 kHz
    got = load_clip({"array": tone, "sampling_rate": 22050})
    assert len(got) == SAMPLE_RATE
    spectrum = np.abs(np.fft.rfft(got))
    assert abs(np.argmax(spectrum) - 440) <= 1                          # 1 Hz bins: the tone stays at 440 Hz


@pytest.mark.parametrize("value,kind,message", [
    ({"array": np.zeros(31 * SAMPLE_RATE, np.float32), "sampling_rate": SAMPLE_RATE}, "audio too long", "31.0 s"),
    ({"array": np.zeros(0, np.float32), "sampling_rate": SAMPLE_RATE}, "empty audio", "empty"),
    ({"array": np.full(100, np.nan, np.float32), "sampling_rate": SAMPLE_RATE}, "unreadable audio", "NaN"),
    ({"sampling_rate": SAMPLE_RATE}, "unreadable audio", "needs 'array'"),
    (12, "unreadable audio", "not an audio value"),
    ("nope.wav", "unreadable audio", "no such file"),
])
def test_load_clip_errors_name_the_problem(value, kind, message):
    with pytest.raises(AudioError, match=message) as e:
        load_clip(value, ".")
    assert e.value.kind == kind
