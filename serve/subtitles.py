"""Transcript segments as OpenAI's verbose_json segments (SRT/WebVTT: enc2dec.engine.whisper.subtitles).

Segments are ``enc2dec.engine.whisper.results.Segment`` (start_s, end_s, text, words).
"""
from __future__ import annotations

import zlib


def verbose_segments(segments, tokenizer) -> list[dict]:
    """OpenAI's segment objects, with the decode measures of each segment's window."""
    out = []
    for i, s in enumerate(segments):
        text = " " + s.text.strip()
        out.append({"id": i, "seek": int(s.start_s / 30) * 3000, "start": round(s.start_s, 2),
                    "end": round(s.end_s, 2), "text": text,
                    "tokens": tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else [],
                    "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                    "compression_ratio": s.compression_ratio or _compression_ratio(text),
                    "no_speech_prob": s.no_speech_prob})
    return out


def verbose_words(segments) -> list[dict]:
    """OpenAI's top-level ``words``: each word without its leading space, punctuation kept."""
    return [{"word": w.word.strip(), "start": round(w.start_s, 2), "end": round(w.end_s, 2)}
            for s in segments for w in s.words]


def _compression_ratio(text: str) -> float:
    raw = text.encode()
    return round(len(raw) / max(1, len(zlib.compress(raw))), 3)
