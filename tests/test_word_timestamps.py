"""Word-timestamp rules without a real checkpoint: DTW against a cell-by-cell reference,
word splitting and punctuation merging on hand-made tokens, window plans, the writers'
word output, engine-thread calls and the CLI's usage errors."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from enc2dec.engine import LLM, KvCacheConfig
from enc2dec.engine.whisper.alignment import _Timing, dtw_path, merge_punctuation, monotone, plan_windows, split_words
from enc2dec.engine.whisper.longform import Piece
from enc2dec.engine.whisper.results import Segment, Word
from enc2dec.engine.whisper.subtitles import render, to_json
from test_transcribe import audio_dir, cli  # noqa: F401 (fixture)


def _dtw_reference(x: np.ndarray):
    """The textbook recurrence, one cell at a time, with the original Whisper's tie rules."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    cost[0, 0] = 0
    trace = np.zeros((n + 1, m + 1), dtype=int)
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j], trace[i, j] = x[i - 1, j - 1] + c, t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    return np.array(path[::-1]).T


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (7, 1), (5, 40), (23, 300), (40, 41)])
def test_dtw_path_equals_the_cell_by_cell_reference(shape):
    x = -np.random.RandomState(sum(shape)).rand(*shape)
    rows, cols = dtw_path(x)
    ref_rows, ref_cols = _dtw_reference(x)
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_array_equal(cols, ref_cols)
    assert rows[0] == cols[0] == 0 and rows[-1] == shape[0] - 1 and cols[-1] == shape[1] - 1


def test_dtw_follows_a_planted_diagonal():
    x = np.full((4, 40), 0.1)
    for r, (a, b) in enumerate([(0, 5), (5, 18), (18, 30), (30, 40)]):
        x[r, a:b] = -1.0                    # token r is spoken in frames [a, b)
    rows, cols = dtw_path(x)
    starts = cols[np.diff(rows, prepend=-1).astype(bool)]
    assert list(starts) == [0, 5, 18, 30]


# ---- words ------------------------------------------------------------------------------------
VOCAB = {1: b" Hello", 2: b",", 3: b" wor", 4: b"ld", 5: b"!", 6: b" \"", 7: b"It", 8: b"\xe6\x97", 9: b"\xa5",
         10: b"\xe6\x9c\xac"}


def _decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_words_split_on_spaces_and_punctuation():
    words, groups = split_words([1, 2, 3, 4, 5], _decode, "en")
    assert words == [" Hello", ",", " world", "!"] and groups == [[1], [2], [3, 4], [5]]


def test_words_without_spaces_split_on_whole_characters():
    words, groups = split_words([8, 9, 10], _decode, "ja")
    assert words == ["日", "本"] and groups == [[8, 9], [10]]


def test_punctuation_joins_its_word_as_the_original_does():
    timings = [_Timing(w, [i], i, i + 1, [0.5]) for i, w in enumerate([" \"", "It", ",", " world", "!", "\""])]
    merge_punctuation(timings)
    kept = [(t.word, t.tokens, t.start_s, t.end_s) for t in timings if t.word]
    assert kept == [(" \"It,", [0, 1, 2], 1, 2), (" world!\"", [3, 4, 5], 3, 4)]
    assert sum(len(t.tokens) for t in timings) == 6       # no token lost


def test_windows_cover_every_piece_once_within_30_s():
    pieces = [Piece(s, s + 4.0, [1]) for s in np.arange(0.0, 70.0, 5.0)] + [Piece(105.0, 109.0, [1])]
    plans = plan_windows(pieces, 110.0)
    assert [k for _, _, members in plans for k in members] == list(range(len(pieces)))
    for start, end, members in plans:
        assert end - start <= 30.0 + 1e-9
        assert all(start <= pieces[k].start_s and pieces[k].end_s <= end for k in members)
    assert plans[-1][0] == pytest.approx(104.0)         # after a long gap: a second before the piece


def test_words_are_put_in_order_and_segments_span_their_words():
    # Two alignment windows may disagree at their join; a segment without words keeps its times.
    a = Segment(0.0, 2.0, "One two.", words=(Word(" One", 0.3, 0.9, 0.9), Word(" two.", 0.9, 2.2, 0.9)))
    b = Segment(2.0, 3.0, "Three", words=(Word(" Three", 2.1, 2.8, 0.9),))
    c = Segment(2.5, 3.5, "...")
    out = monotone([a, b, c])
    assert [(s.start_s, s.end_s) for s in out] == [(0.3, 2.2), (2.2, 2.8), (2.8, 3.5)]
    assert out[1].words[0][1:3] == (2.2, 2.8) and out[0].words == a.words


# ---- writers ----------------------------------------------------------------------------------
def _transcript():
    words = (Word(" Hello,", 0.5, 0.9, 0.9), Word(" world.", 1.0, 1.52, 0.8))
    return SimpleNamespace(source="a.wav", language="en", duration_s=2.0, text="Hello, world.",
                           segments=[Segment(0.5, 1.52, "Hello, world.", words=words), Segment(1.6, 1.9, "Hi")])


def test_json_carries_words_and_srt_vtt_a_cue_per_word():
    import json

    data = json.loads(to_json(_transcript()))
    assert data["segments"][0]["words"] == [
        {"word": " Hello,", "start": 0.5, "end": 0.9, "probability": 0.9},
        {"word": " world.", "start": 1.0, "end": 1.52, "probability": 0.8}]
    assert "words" not in data["segments"][1]
    assert render(_transcript(), "srt", words=True) == (
        "1\n00:00:00,500 --> 00:00:00,900\nHello,\n\n2\n00:00:01,000 --> 00:00:01,520\nworld.\n\n")
    assert render(_transcript(), "vtt", words=True).split("\n\n")[1:3] == [
        "00:00:00.500 --> 00:00:00.900\nHello,", "00:00:01.000 --> 00:00:01.520\nworld."]
    assert render(_transcript(), "srt").count("-->") == 2     # per segment unless asked


# ---- engine thread and CLI --------------------------------------------------------------------
def test_calls_run_on_the_engine_thread_and_raise_to_the_caller(whisper):
    with LLM(whisper, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        assert llm.call_on_engine(lambda core: (threading.current_thread().name, core is llm.engine)).result(
            timeout=30) == ("enc2dec-engine", True)
        with pytest.raises(ZeroDivisionError):
            llm.call_on_engine(lambda core: 1 / 0).result(timeout=30)
        assert llm.generate({"prompt": "", "multi_modal_data": {"audio": [(np.zeros(16000, np.float32), 16000)]}},
                            use_tqdm=False).finished          # the loop lives on after a failed call
    with pytest.raises(RuntimeError, match="shut down"):
        llm.call_on_engine(lambda core: None)


def test_cli_subtitle_words_needs_a_subtitle_format(whisper, audio_dir):  # noqa: F811
    r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--quiet", "--subtitle-words", "-f", "json")
    assert r.exit_code == 2, r.output
    assert "--subtitle-words applies to srt and vtt output" in r.stderr and "Traceback" not in r.output
