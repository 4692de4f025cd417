"""Transcript segments as OpenAI's verbose_json segments, SRT and WebVTT.

Segments are ``(start_s, end_s, text)`` triples (``enc2dec.engine.transcribe.Segment``).
"""
from __future__ import annotations

import zlib


def verbose_segments(segments, tokenizer, temperature: float) -> list[dict]:
    """OpenAI's segment objects. avg_logprob and no_speech_prob are not computed (0.0)."""
    out = []
    for i, s in enumerate(segments):
        text = " " + s.text.strip()
        out.append({"id": i, "seek": int(s.start_s / 30) * 3000, "start": round(s.start_s, 2),
                    "end": round(s.end_s, 2), "text": text,
                    "tokens": tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else [],
                    "temperature": temperature, "avg_logprob": 0.0,
                    "compression_ratio": _compression_ratio(text), "no_speech_prob": 0.0})
    return out


def _compression_ratio(text: str) -> float:
    raw = text.encode()
    return round(len(raw) / max(1, len(zlib.compress(raw))), 3)


def _stamp(seconds: float, sep: str) -> str:
    ms = round(max(0.0, seconds) * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(segments) -> str:
    return "".join(f"{i}\n{_stamp(s.start_s, ',')} --> {_stamp(s.end_s, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def to_vtt(segments) -> str:
    return "WEBVTT\n\n" + "".join(f"{_stamp(s.start_s, '.')} --> {_stamp(s.end_s, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)
