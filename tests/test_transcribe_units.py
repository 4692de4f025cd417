"""enc2dec transcribe's pieces without a model: long-form windows, timestamp parsing, chunk
stitching, the Whisper logits rules against transformers' own, subtitle writers, audio
loading and the special-token tables."""
from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import soundfile as sf
import torch
from enc2dec.engine.whisper.audio import AudioError, expand_inputs, load_audio, probe_duration_s
from enc2dec.engine.whisper.longform import (Merged, Piece, chunk_windows, closed_pieces, merge_chunk, merged_pieces,
                                     monotonic, parse_window)
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.whisper.subtitles import clock, output_stems, render
from enc2dec.engine.whisper.decoding import WindowStats
from enc2dec.engine.whisper.transcribe import Segment, Transcript
from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules
from enc2dec.engine.whisper.tokens import IdOnlyTokenizer, WhisperTokens

EOT, TS = 100, 200            # a toy vocabulary: text < 100, timestamps from 200 (<|0.00|>)


def ts(seconds: float) -> int:
    return TS + int(round(seconds / 0.02))


# ---- parse_window ---------------------------------------------------------------------------
def test_parse_window_closed_pairs_open_tail_and_seek_point():
    ids = [ts(0), 1, 2, ts(2), ts(2.5), 3, ts(4), ts(4.2), 5, 6, EOT]     # the last piece never closes
    r = parse_window(ids, EOT, TS, start_s=10.0, length_s=30.0, timestamps=True)
    assert [(p.start_s, p.end_s, p.token_ids) for p in r.pieces] == [
        (10.0, 12.0, [1, 2]), (12.5, 14.0, [3]), (14.2, 40.0, [5, 6])]
    assert r.consumed_s == pytest.approx(4.0)           # the next window starts where piece 2 ended
    assert [p.token_ids for p in closed_pieces(r, 10.0)] == [[1, 2], [3]]


def test_parse_window_lone_final_timestamp_consumes_the_window():
    ids = [ts(0), 1, ts(3), ts(3), 2, ts(7.5), EOT]
    r = parse_window(ids, EOT, TS, 0.0, 30.0, True)
    assert [(p.start_s, p.end_s) for p in r.pieces] == [(0.0, 3.0), (3.0, 7.5)]
    assert r.consumed_s == 30.0 and len(closed_pieces(r, 0.0)) == 2


def test_parse_window_without_pairs_or_timestamps():
    r = parse_window([ts(0.4), 7, 8, EOT], EOT, TS, 5.0, 12.0, True)     # max_tokens hit: no closing stamp
    assert [(p.start_s, p.end_s, p.token_ids) for p in r.pieces] == [(5.4, 17.0, [7, 8])]
    assert r.consumed_s == 12.0
    r = parse_window([7, 8, EOT], EOT, TS, 5.0, 12.0, False)
    assert [(p.start_s, p.end_s, p.token_ids) for p in r.pieces] == [(5.0, 17.0, [7, 8])]
    assert parse_window([EOT], EOT, TS, 0.0, 3.0, True).pieces == []


def test_parse_window_never_stalls_and_clamps_to_the_window():
    r = parse_window([ts(0), ts(0), 4, EOT], EOT, TS, 0.0, 8.0, True)    # a pair at 0.00: no progress
    assert r.consumed_s == 8.0
    r = parse_window([ts(0), 4, ts(29), ts(29), 5, EOT], EOT, TS, 0.0, 6.0, True)   # a short last window
    assert r.pieces[0].end_s == 6.0 and r.consumed_s == 6.0


# ---- chunk plans and stitching ---------------------------------------------------------------
def test_chunk_windows_cover_the_audio_and_start_in_pauses():
    sr = 1000
    rng = np.random.default_rng(0)
    wave = rng.standard_normal(100 * sr).astype(np.float32)
    quiet = [(23.0, 24.0), (47.5, 48.5), (71.0, 72.0)]
    for a, b in quiet:
        wave[int(a * sr):int(b * sr)] *= 1e-3
    spans = chunk_windows(wave, sr)
    assert spans[0][0] == 0 and spans[-1][1] == len(wave)
    for (s0, e0), (s1, e1) in itertools.pairwise(spans):
        assert e0 - s0 <= 30 * sr and s1 < e0 and e0 - s1 >= 2 * sr       # overlapping, at most 30 s
        assert any(a <= s1 / sr <= b for a, b in quiet), s1 / sr          # the start moved into a pause
    assert chunk_windows(wave[:20 * sr], sr) == [(0, 20 * sr)]


def _merge(chunks, overlaps):
    merged = Merged()
    for pieces, overlap in zip(chunks, overlaps):
        merge_chunk(merged, pieces, overlap)
    return merged_pieces(merged)


def _flat(pieces):
    return [t for p in pieces for t in p.token_ids]


def test_merge_splices_inside_the_overlap_without_duplicates():
    left = [Piece(0, 10, list(range(1, 21))), Piece(10, 30, list(range(21, 41)))]
    right = [Piece(25, 30, [37, 38, 39, 40, 41]), Piece(30, 40, [42, 43, 44])]   # a cut word (37) included
    out = _merge([left, right], [(0, 0), (25, 30)])
    assert _flat(out) == list(range(1, 45))
    assert [(p.start_s, p.end_s) for p in out] == [(0, 10), (10, 30), (30, 40)]


def test_merge_joins_the_piece_the_splice_cuts_in_two():
    left = [Piece(0, 20, list(range(1, 21))), Piece(20, 30, list(range(21, 31)))]
    right = [Piece(25, 35, list(range(26, 36))), Piece(35, 50, [36, 37])]
    out = _merge([left, right], [(0, 0), (25, 30)])
    assert _flat(out) == list(range(1, 38))
    assert [(p.start_s, p.end_s) for p in out] == [(0, 20), (20, 35), (35, 50)]


def test_merge_a_phrase_recurring_across_the_overlap_does_not_collapse_the_stretch_between():
    # "7 8 9 10" is said at 22-26 s and again at 30.5-34 s; only "50 51 52" (26-30 s) lies in
    # both windows. Matching the phrase's two utterances would drop 50 51 52 and one utterance.
    phrase = [7, 8, 9, 10]
    left = [Piece(0, 22, list(range(20, 40))), Piece(22, 26, phrase), Piece(26, 30, [50, 51, 52])]
    right = [Piece(25, 30, [50, 51, 52]), Piece(30.5, 34, phrase), Piece(34, 55, list(range(60, 80)))]
    out = _flat(_merge([left, right], [(0, 0), (25, 30)]))
    assert out == list(range(20, 40)) + phrase + [50, 51, 52] + phrase + list(range(60, 80))


def test_merge_keeps_everything_outside_the_overlap_when_the_windows_disagree():
    left = [Piece(0, 26, list(range(1, 27))), Piece(26, 30, [90, 91, 92, 93])]
    right = [Piece(25, 30, [80, 81, 82, 83, 84]), Piece(30, 40, list(range(31, 41)))]
    out = _flat(_merge([left, right], [(0, 0), (25, 30)]))
    # No shared run: each side keeps what it heard up to the middle of the overlap (27.5 s).
    assert out[:26] == list(range(1, 27)) and out[-10:] == list(range(31, 41))
    assert out[26:-10] == [90, 82, 83, 84]


def test_merge_ignores_a_repeat_far_from_the_overlap_and_silent_overlaps():
    phrase = [7, 8, 9, 10]
    left = [Piece(0, 30, phrase + list(range(20, 60)) + [61, 62])]
    right = [Piece(25, 32, [61, 62, 63]), Piece(50, 54, phrase)]           # the phrase again, later on
    assert _flat(_merge([left, right], [(0, 0), (25, 30)])) == phrase + list(range(20, 60)) + [61, 62, 63] + phrase
    silent = _merge([[Piece(0, 20, [1, 2, 3])], [Piece(31, 55, [4, 5])]], [(0, 0), (25, 30)])
    assert _flat(silent) == [1, 2, 3, 4, 5]
    assert [(p.start_s, p.end_s) for p in silent] == [(0, 20), (31, 55)]


def test_stitched_and_clamped_pieces_keep_the_measures_of_their_window():
    first, second = WindowStats(0.0, -0.2, 1.5, 0.01), WindowStats(0.2, -0.7, 1.9, 0.05)
    left = parse_window([TS + 0, 1, 2, 3, TS + 1250, TS + 1250, 4, 5, TS + 1500], EOT, TS, 0.0, 30.0, True, first)
    right = parse_window([TS + 0, 4, 5, 6, TS + 400, TS + 400, 7, 8, TS + 1000], EOT, TS, 25.0, 30.0, True, second)
    out = monotonic(_merge([left.pieces, right.pieces], [(0, 0), (25, 30)]), 60.0)
    assert _flat(out) == [1, 2, 3, 4, 5, 6, 7, 8]
    # The piece the splice joins is the left window's; what only the right window heard is its own.
    assert [p.stats for p in out] == [first, first, second]


def test_monotonic_clamps_into_the_audio():
    out = monotonic([Piece(-1, 2, [1]), Piece(1.5, 3, [2]), Piece(9, 12, [3])], 10.0)
    assert [(p.start_s, p.end_s) for p in out] == [(0, 2), (2, 3), (9, 10)]


# ---- logits rules ------------------------------------------------------------------------------
def test_timestamp_rules_match_transformers_processor():
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    vocab, no_ts, eot, begin = 2000, 449, 400, 3
    gen = GenerationConfig(eos_token_id=eot, bos_token_id=eot, no_timestamps_token_id=no_ts,
                           max_initial_timestamp_index=50)
    hf = WhisperTimeStampLogitsProcessor(gen, begin_index=begin)
    ours = TimestampRules(begin, eot, no_ts, no_ts + 1, 50)
    rng = np.random.default_rng(0)
    for case in range(300):
        n = int(rng.integers(0, 12))
        # Histories that follow the grammar often and break it sometimes.
        seq = [int(rng.choice([rng.integers(0, eot), rng.integers(no_ts + 1, vocab)])) for _ in range(n)]
        prefix = [1, 2, 3]
        scale = float(rng.choice([1.0, 8.0]))
        logits = torch.tensor(rng.standard_normal(vocab) * scale, dtype=torch.float32)
        logits[no_ts + 1:] += float(rng.choice([-3.0, 0.0, 4.0]))
        expect = hf(torch.tensor([prefix + seq]), logits[None].clone())[0]
        row = logits.clone()
        ours(prefix + seq, row)
        assert torch.equal(torch.isinf(row), torch.isinf(expect)), (case, seq)
        assert int(row.argmax()) == int(expect.argmax())


def test_detect_language_then_forced_tokens_and_begin_suppress():
    rule = DetectLanguage([5, 9], forced=[20, 30])
    row = torch.arange(40, dtype=torch.float32)
    rule([], row)
    assert torch.isinf(row).sum() == 38 and int(row.argmax()) == 9
    row = torch.full((40,), float("-inf"))          # the suppress list already hid the task token
    rule([-1], row)
    assert int(row.argmax()) == 20 and row[20] == 0
    row = torch.zeros(40)
    rule([-1, -1], row)
    assert int(row.argmax()) == 30
    row = torch.arange(40, dtype=torch.float32)
    rule([-1, -1, -1], row)
    assert not torch.isinf(row).any()
    sup = SuppressAtBegin(3, (39, 38))
    sup([-1, -1, -1], row)
    assert torch.isinf(row[[38, 39]]).all() and int(row.argmax()) == 37
    # Only the timestamp rules read token values (a host copy per step); these need the count.
    assert DetectLanguage.needs_token_ids is False and SuppressAtBegin.needs_token_ids is False
    assert getattr(TimestampRules, "needs_token_ids", True)


def test_sampling_params_rejects_non_callable_processors():
    with pytest.raises(ValueError, match="logits_processors must be callables"):
        SamplingParams(logits_processors=[3])


# ---- special tokens --------------------------------------------------------------------------
def _tokens(multilingual=True):
    from transformers import GenerationConfig

    gen = GenerationConfig(decoder_start_token_id=50, eos_token_id=40, no_timestamps_token_id=60,
                           begin_suppress_tokens=[40])
    gen.lang_to_id, gen.task_to_id = {"<|en|>": 51, "<|de|>": 52}, {"translate": 55, "transcribe": 56}
    gen.is_multilingual = multilingual
    return WhisperTokens.from_generation_config(gen, vocab_size=61 + 1501)


def test_prefixes_languages_and_tasks():
    tok = _tokens()
    assert tok.prefix("de", "translate", timestamps=False) == [50, 52, 55, 60]
    assert tok.prefix("en", "transcribe", timestamps=True) == [50, 51, 56]
    assert tok.prefix(None, "transcribe", timestamps=False) == [50]      # detection comes first
    assert tok.forced_after_language("transcribe", False) == [56, 60]
    assert tok.language_code("German") == "de" and tok.language_code("<|en|>") == "en"
    with pytest.raises(ValueError, match="'klingon' is not one this checkpoint knows; valid codes include de, en"):
        tok.language_code("klingon")
    english = _tokens(multilingual=False)
    assert english.prefix("en", "transcribe", False) == [50, 60]
    with pytest.raises(ValueError, match="English-only"):
        english.check_task("translate")
    with pytest.raises(ValueError, match="valid: transcribe, translate"):
        tok.check_task("summarize")


def test_id_only_tokenizer_round_trips_special_prompts():
    shim = IdOnlyTokenizer(_tokens())
    assert shim.encode("<|startoftranscript|><|de|><|transcribe|>") == [50, 52, 56]
    assert "".join(shim.convert_ids_to_tokens([50, 51])) == "<|startoftranscript|><|en|>"
    assert shim.decode([50, 7, 8, 40], skip_special_tokens=True) == "<7><8>"
    with pytest.raises(ValueError, match="no tokenizer"):
        shim.encode("hello")


# ---- writers -----------------------------------------------------------------------------------
def _transcript():
    return Transcript("a/talk.wav", "Hello there. General Kenobi --> yes",
                      [Segment(0.0, 1.5, "Hello there."), Segment(1.5, 3661.0006, "General Kenobi --> yes")],
                      "en", 3662.0)


def test_clock_rounding():
    assert clock(59.9996) == "00:01:00.000" and clock(3661.0006, ",") == "01:01:01,001"
    assert clock(5.25, always_hours=False) == "00:05.250"


def test_srt_vtt_tsv_json_and_txt():
    t = _transcript()
    srt = render(t, "srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n00:00:01,500 --> 01:01:01,001\n")
    assert "-->" not in srt.split("\n")[6]                      # the cue text cannot end the timing line
    vtt = render(t, "vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n")
    assert render(t, "tsv").splitlines() == ["start\tend\ttext", "0\t1500\tHello there.",
                                             "1500\t3661001\tGeneral Kenobi -> yes"]
    data = json.loads(render(t, "json"))
    assert data["language"] == "en" and data["duration_s"] == 3662.0 and len(data["segments"]) == 2
    assert render(t, "txt").splitlines()[0] == "[00:00.000 --> 00:01.500]  Hello there."
    t.segments = []
    assert render(t, "txt") == t.text + "\n"
    with pytest.raises(ValueError, match="valid: txt, srt"):
        render(t, "docx")


def test_output_stems_are_distinct():
    stems = output_stems(["a/x.wav", "a/x.flac", "b/x.wav", "c/y.mp3"])
    assert stems == {"a/x.wav": "x.wav", "a/x.flac": "x.flac", "b/x.wav": "x.wav-2", "c/y.mp3": "y"}


# ---- audio ---------------------------------------------------------------------------------------
def test_load_audio_mixes_resamples_and_reports_bad_files(tmp_path):
    sr_in = 44100
    t = np.arange(int(1.5 * sr_in)) / sr_in
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    stereo = np.stack([tone, tone], axis=1)
    for ext in ("wav", "flac", "ogg"):
        path = tmp_path / f"tone.{ext}"
        sf.write(path, stereo, sr_in)
        wave = load_audio(str(path), 16000)
        assert wave.dtype == np.float32 and wave.ndim == 1 and abs(len(wave) - 24000) <= 1
        assert probe_duration_s(str(path)) == pytest.approx(1.5, abs=1e-3)
        spectrum = np.abs(np.fft.rfft(wave))
        assert abs(np.argmax(spectrum) * 16000 / len(wave) - 440) < 2        # still a 440 Hz tone
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF0000WAVEfmt garbage" * 10)
    with pytest.raises(AudioError, match="cannot read .*bad.wav.*corrupt"):
        load_audio(str(bad), 16000)
    with pytest.raises(AudioError, match="no such file"):
        load_audio(str(tmp_path / "missing.wav"), 16000)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros((0, 1), np.float32), 16000)
    with pytest.raises(AudioError, match="holds no audio samples"):
        probe_duration_s(str(empty))


def test_expand_inputs_folders_and_problems(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.wav", "d/sub/a.FLAC", "d/notes.txt", "x.mp3"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "empty").mkdir()
    files, problems = expand_inputs([str(tmp_path / "d"), str(tmp_path / "x.mp3"), str(tmp_path / "nope.wav"),
                                     str(tmp_path / "empty")])
    assert [re.sub(".*/d/", "", f) for f in files[:2]] == ["b.wav", "sub/a.FLAC"] and files[2].endswith("x.mp3")
    assert any("nope.wav: no such file" in p for p in problems)
    assert any("holds no audio files" in p for p in problems)
