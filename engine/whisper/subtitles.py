"""Transcript writers: txt, srt, vtt, json, tsv.

srt and vtt follow the formats players read (SubRip ``HH:MM:SS,mmm``, WebVTT
``HH:MM:SS.mmm`` after a ``WEBVTT`` header); tsv is ``start``/``end`` in integer
milliseconds and the text, as the original Whisper writes it; json holds everything (with
word timestamps, each segment's ``words``). ``words=True`` makes srt and vtt one cue per word.
"""
from __future__ import annotations

import json
import os

FORMATS = ("txt", "srt", "vtt", "json", "tsv")
TIMED_FORMATS = ("srt", "vtt", "json", "tsv")      # decoded with timestamps whatever the flag says


def clock(seconds: float, decimal: str = ".", always_hours: bool = True) -> str:
    ms = max(0, int(round(seconds * 1000)))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    head = f"{hours:02d}:" if always_hours or hours else ""
    return f"{head}{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _cue_text(text: str) -> str:
    # One line per cue; "-->" would end a WebVTT cue's timing line early.
    return " ".join(text.split()).replace("-->", "->")


def to_txt(t) -> str:
    if not t.segments:
        return t.text + "\n"
    return "".join(f"[{clock(s.start_s, always_hours=False)} --> {clock(s.end_s, always_hours=False)}]  "
                   f"{_cue_text(s.text)}\n" for s in t.segments)


def _cues(t, words: bool) -> list[tuple[float, float, str]]:
    if words:
        return [(w.start_s, w.end_s, w.word) for s in t.segments for w in s.words]
    return [(s.start_s, s.end_s, s.text) for s in t.segments]


def to_srt(t, words: bool = False) -> str:
    return "".join(f"{i}\n{clock(a, ',')} --> {clock(b, ',')}\n{_cue_text(text)}\n\n"
                   for i, (a, b, text) in enumerate(_cues(t, words), 1))


def to_vtt(t, words: bool = False) -> str:
    return "WEBVTT\n\n" + "".join(f"{clock(a)} --> {clock(b)}\n{_cue_text(text)}\n\n" for a, b, text in _cues(t, words))


def to_tsv(t) -> str:
    rows = [f"{int(round(s.start_s * 1000))}\t{int(round(s.end_s * 1000))}\t{_cue_text(s.text).replace(chr(9), ' ')}"
            for s in t.segments]
    return "start\tend\ttext\n" + "".join(r + "\n" for r in rows)


def _measures(s) -> dict:
    """The window measures of a segment (the original Whisper's json has them too)."""
    return {k: getattr(s, k) for k in ("avg_logprob", "compression_ratio", "no_speech_prob", "temperature")}


def to_json(t) -> str:
    data = {
        "source": t.source, "language": t.language, "duration_s": round(t.duration_s, 3), "text": t.text,
        "segments": [_json_segment(s) for s in t.segments],
    }
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def _json_segment(s) -> dict:
    out = {"start": s.start_s, "end": s.end_s, "text": s.text, **_measures(s)}
    if s.words:
        out["words"] = [{"word": w.word, "start": w.start_s, "end": w.end_s, "probability": w.probability}
                        for w in s.words]
    return out


_WRITERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "json": to_json, "tsv": to_tsv}


WORD_CUE_FORMATS = ("srt", "vtt")


def render(t, fmt: str, words: bool = False) -> str:
    """``words``: one srt/vtt cue per word (the segments need their words)."""
    if fmt not in _WRITERS:
        raise ValueError(f"output format {fmt!r} is not valid; valid: {', '.join(FORMATS)}, all")
    return _WRITERS[fmt](t, words) if fmt in WORD_CUE_FORMATS else _WRITERS[fmt](t)


def output_stems(sources: list[str]) -> dict[str, str]:
    """A distinct file stem per source: ``talk`` for talk.wav, ``talk.flac`` when talk.wav is
    also there, ``talk-2`` when even that clashes (files from different folders)."""
    stems: dict[str, str] = {}
    taken: set[str] = set()
    bases = [os.path.splitext(os.path.basename(s))[0] or "audio" for s in sources]
    for src, base in zip(sources, bases):
        stem = base if bases.count(base) == 1 else os.path.basename(src)
        candidate, n = stem, 1
        while candidate in taken:
            n += 1
            candidate = f"{stem}-{n}"
        taken.add(candidate)
        stems[src] = candidate
    return stems


def write_outputs(t, formats: list[str], out_dir: str, stem: str, words: bool = False) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for fmt in formats:
        path = os.path.join(out_dir, f"{stem}.{fmt}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(t, fmt, words))
        paths.append(path)
    return paths
