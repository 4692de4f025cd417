"""Audio uploads in: bytes -> mono float32 at the checkpoint's rate, or a 400.

Read by the engine's one audio reader (``enc2dec.engine.whisper.audio.read_audio``:
libsndfile, channel mixing, soxr), as ``enc2dec transcribe`` reads files: the length limit
is checked from the header first and decoding stops at it, so an upload that claims hours
(or a 10 Hz rate) costs no more memory than the longest allowed clip.
"""
from __future__ import annotations

import numpy as np

from .errors import bad_request


def decode_upload(data: bytes, filename: str | None, sample_rate: int, max_seconds: float) -> np.ndarray:
    """[num_samples] float32 at ``sample_rate``; runs in the input pool, never on the loop."""
    from enc2dec.engine.whisper.audio import AudioError, read_audio

    name = filename or "the upload"
    if not data:
        raise bad_request(f"{name} is empty", "file")
    try:
        return read_audio(data, sample_rate, max_seconds, name=name, hint=" per request (--max-audio-s)")
    except AudioError as e:
        raise bad_request(str(e), "file", "audio_too_long" if e.kind == "audio too long" else None) from None
