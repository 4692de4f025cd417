"""transcribe --strategy vad: windows packed from speech regions, their times mapped back to
the file, silence and noise decoded to nothing, the missing extra named; with the real
tiny.en checkpoint and Silero VAD where marked ``real``."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from enc2dec.cli.main import app
from enc2dec.engine.whisper.longform import Piece, unheard_from
from enc2dec.engine.whisper.vad import VadWindow, pack_windows
from typer.testing import CliRunner

SR = 16000


# ---- the plan, without a model -----------------------------------------------------------------
def test_pack_windows_fills_windows_in_order_and_cuts_an_overlong_region():
    regions = [(0, 10), (20, 35), (40, 48), (60, 61), (70, 100)]
    windows = pack_windows(regions, max_samples=25)
    assert [w.regions for w in windows] == [((0, 10), (20, 35)), ((40, 48), (60, 61)), ((70, 95),), ((95, 100),)]
    assert all(w.num_samples <= 25 for w in windows)
    assert [r for w in windows for r in w.regions][:4] == regions[:4]        # nothing lost or reordered
    assert pack_windows([], 25) == []


def test_window_seconds_map_to_the_file_across_the_left_out_silence():
    w = VadWindow(((20 * SR, 25 * SR), (40 * SR, 50 * SR)))      # 5 s of speech, 15 s of silence, 10 s
    assert w.num_samples == 15 * SR and len(w.audio(np.arange(60 * SR))) == 15 * SR
    assert w.to_file_s(0.0, SR) == 20.0
    assert w.to_file_s(3.0, SR) == 23.0
    assert w.to_file_s(5.0, SR, is_end=True) == 25.0          # a segment that ends on the seam ends in region 1
    assert w.to_file_s(5.0, SR) == 40.0                       # one that starts there starts in region 2
    assert w.to_file_s(7.5, SR) == 42.5
    assert w.to_file_s(30.0, SR, is_end=True) == 50.0         # past the window: clamped to its speech
    # A segment whose boundary Whisper put a little before or after the seam stays on its speech.
    assert w.span_to_file_s(4.6, 9.0, SR) == (40.0, 44.0)
    assert w.span_to_file_s(1.0, 5.5, SR) == (21.0, 25.0)
    assert w.span_to_file_s(2.0, 9.0, SR) == (22.0, 44.0)    # one that truly spans both keeps its ends


def test_unheard_from_only_when_words_stop_early():
    pieces = [Piece(0.0, 4.0, [1]), Piece(4.0, 9.0, [2])]
    assert unheard_from(pieces, 20.0) == 9.0                  # 11 s that only this window hears, unheard
    assert unheard_from(pieces, 9.5) is None                  # ends with the audio (within the gap)
    assert unheard_from([], 20.0) is None                     # heard nothing at all: silence or noise


@pytest.fixture
def no_silero(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "silero_vad"
                        else real_find_spec(name, *a))


def test_cli_default_strategy_names_the_install_and_the_alternatives_when_silero_vad_is_missing(no_silero, tmp_path):
    sf.write(tmp_path / "short.wav", np.zeros(SR, np.float32), SR)
    sf.write(tmp_path / "long.wav", np.zeros(31 * SR, np.float32), SR)
    # Checked from the headers before the model loads (the model name here would fail to load).
    r = CliRunner().invoke(app, ["transcribe", str(tmp_path), "--model", "unused"])
    assert r.exit_code == 2, r.output
    assert 'pip install "enc2dec[audio]"' in r.stderr and "--strategy chunked or --strategy sequential" in r.stderr
    assert "long.wav" in r.stderr and "Traceback" not in r.output


def test_the_vad_strategy_is_the_default_everywhere():
    import inspect

    from enc2dec.cli.transcribe import transcribe as cli_transcribe
    from enc2dec.engine.whisper.transcribe import DEFAULT_STRATEGY, STRATEGIES, transcribe, transcribe_async
    from enc2dec.serve.config import LONG_FORM_STRATEGIES, ServeConfig

    assert DEFAULT_STRATEGY == "vad" and LONG_FORM_STRATEGIES == STRATEGIES
    for fn in (transcribe, transcribe_async, cli_transcribe):
        assert inspect.signature(fn).parameters["strategy"].default == "vad", fn
    assert ServeConfig(model="m").long_form_strategy == "vad"
    with pytest.raises(ValueError, match="valid: vad, chunked, sequential"):
        ServeConfig(model="m", long_form_strategy="fast")


# ---- real tiny.en and Silero VAD ------------------------------------------------------------------
def _placed(real_whisper, plan):
    """A wave of silence with clips (manifest rows) placed at the given seconds: (wave, [(start_s, end_s)])."""
    rows, clips = real_whisper.clips()
    total_s = max(at + len(clips[k][0]) / SR for k, at in plan) + 2.0
    wave, spans = np.zeros(int(total_s * SR), np.float32), []
    for k, at in plan:
        clip = clips[k][0]
        wave[int(at * SR):int(at * SR) + len(clip)] = clip
        spans.append((at, at + len(clip) / SR))
    return wave, spans, [rows[k]["text"] for k, _ in plan]


@pytest.mark.real
def test_without_silero_vad_short_files_still_decode_and_long_ones_fail_before_any_window(no_silero, monkeypatch,
                                                                                       real_whisper, real_tiny_llm):
    from enc2dec.engine.whisper.transcribe import transcribe

    wave, _, _ = _placed(real_whisper, [(1, 1.0)])
    assert len(wave) <= 30 * SR
    t, = transcribe(real_tiny_llm, [(wave, SR)])
    assert t.error is None and "young man" in t.text.lower()
    started = []
    real_generate = real_tiny_llm.generate_async

    def counting(*a, **kw):
        started.append(1)
        return real_generate(*a, **kw)

    monkeypatch.setattr(real_tiny_llm, "generate_async", counting)
    with pytest.raises(ValueError, match=r'pip install "enc2dec\[audio\]", or pass strategy="chunked"'):
        transcribe(real_tiny_llm, [(wave, SR), (np.concatenate([wave, np.zeros(30 * SR, np.float32)]), SR)])
    assert started == []            # the short file did not decode first only to be thrown away


@pytest.mark.real
def test_a_clip_of_at_most_30_s_decodes_as_one_window_whatever_the_strategy(real_whisper, real_tiny_llm):
    from enc2dec.engine.whisper.transcribe import transcribe

    # Silence either side of the speech: vad would cut it out, but a short clip is one window as is.
    wave, _, _ = _placed(real_whisper, [(1, 8.0)])
    runs = {s: transcribe(real_tiny_llm, [(wave, SR)], strategy=s, timestamps=True)[0] for s in ("vad", "chunked")}
    assert runs["vad"].segments == runs["chunked"].segments and runs["vad"].text == runs["chunked"].text
    assert runs["vad"].segments[0].start_s < 7.0         # the window opens at 0 s, not at the speech


@pytest.mark.real
def test_vad_segments_land_on_the_speech_in_the_file(real_whisper, real_tiny_llm):
    from enc2dec.engine.whisper.transcribe import transcribe

    # Clip 1 ("he was not an ill disposed young man") after 20 s of silence, clip 4 after 18 s more.
    wave, spans, refs = _placed(real_whisper, [(1, 20.0), (4, 41.0)])
    t, = transcribe(real_tiny_llm, [(wave, SR)], strategy="vad", timestamps=True)
    assert t.error is None and t.duration_s == pytest.approx(len(wave) / SR)
    assert "young man" in t.segments[0].text.lower() and "amiable himself" in t.segments[-1].text.lower()
    for seg in t.segments:      # each segment lies on the clip it transcribes, give or take the pad
        assert any(a - 1.0 <= seg.start_s < seg.end_s <= b + 1.0 for a, b in spans), (seg, spans)
    assert t.segments[0].start_s >= 19.0 and t.segments[-1].start_s >= 40.0


@pytest.mark.real
def test_a_vad_window_decodes_to_the_end_of_its_speech_in_one_request(real_whisper, real_tiny_llm):
    import jiwer
    from enc2dec.engine.whisper.transcribe import transcribe
    from enc2dec.engine.whisper.vad import speech_regions
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    # Clips 0.4-0.9 s apart (the opening of longform_wer.py's shuffle_300s): left to itself,
    # tiny.en closes the first window with its last sentence unheard.
    plan = [(5, 0.0), (1, 3.47), (2, 6.82), (0, 13.0), (3, 20.68), (4, 27.31), (1, 31.1), (0, 34.48), (4, 42.28)]
    wave, spans, refs = _placed(real_whisper, plan)
    num_windows = len(pack_windows(speech_regions(wave, SR, 30.0), 30 * SR))
    t, = transcribe(real_tiny_llm, [(wave, SR)], strategy="vad", timestamps=True)
    assert t.error is None and num_windows == 2
    assert t.num_windows == num_windows             # one request per window: nothing left over to retry
    norm = EnglishTextNormalizer({})
    out = jiwer.process_words(norm(" ".join(refs)), norm(t.text))
    assert out.wer < 0.05, t.text
    assert max((c.ref_end_idx - c.ref_start_idx for c in out.alignments[0] if c.type == "delete"), default=0) <= 1
    for seg in t.segments:          # on the speech, in the file's seconds
        assert spans[0][0] - 0.5 <= seg.start_s < seg.end_s <= spans[-1][1] + 0.5, seg


@pytest.mark.real
def test_vad_turns_a_minute_of_silence_or_noise_into_no_text(real_whisper, real_tiny_llm):
    from enc2dec.engine.whisper.transcribe import transcribe

    silence = np.zeros(60 * SR, np.float32)
    noise = (0.1 * np.random.default_rng(0).standard_normal(60 * SR)).astype(np.float32)
    quiet, loud = transcribe(real_tiny_llm, [(silence, SR), (noise, SR)], strategy="vad", timestamps=True)
    for t in (quiet, loud):
        assert t.error is None and t.text == "" and t.segments == [] and t.num_windows == 0


@pytest.mark.real
def test_cli_vad_strategy_writes_the_transcript(real_whisper, tmp_path):
    wave, _, refs = _placed(real_whisper, [(1, 12.0), (2, 30.0)])
    path = tmp_path / "gaps.wav"
    sf.write(path, wave, SR)
    r = CliRunner().invoke(app, ["transcribe", str(path), "--strategy", "vad", "--model", str(real_whisper.tiny_en),
                                 "-f", "json", "-o", str(tmp_path / "out"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "(vad," in r.stderr
    data = json.loads((tmp_path / "out" / "gaps.json").read_text())
    assert "young man" in data["text"].lower() and "selfish" in data["text"].lower()
    assert data["segments"][0]["start"] >= 11.0


def test_silero_preloaded_beside_the_engine_load_is_loaded_once_and_leaves_torch_threads_alone():
    """``enc2dec transcribe --strategy vad`` loads Silero on a thread while the checkpoint loads;
    the first long file then finds it loaded (one load, however the two calls interleave), and
    silero_vad's import, which sets torch to one thread, leaves the engine's thread count as it was."""
    pytest.importorskip("silero_vad")
    import threading

    import torch
    from enc2dec.engine.whisper import vad

    threads = torch.get_num_threads()
    vad._load_model.cache_clear()
    vad.preload_in_background()
    vad.preload_in_background()
    wave = np.zeros(16000 * 3, dtype=np.float32)
    assert vad.speech_regions(wave, 16000, 30.0) == []           # silence: no speech
    for t in threading.enumerate():
        if t.name == "enc2dec-vad-load":
            t.join(30)
    assert vad._load_model.cache_info().misses == 1
    assert torch.get_num_threads() == threads
