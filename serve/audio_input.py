"""Audio uploads in: bytes -> mono float32 at the checkpoint's rate, or a 400.

Decoding is libsndfile's (WAV, FLAC, OGG/Opus, MP3); channel mixing and resampling are the
engine's (``enc2dec.engine.whisper.audio``, soxr), the same as ``enc2dec transcribe`` uses.
"""
from __future__ import annotations

import io

import numpy as np

from .errors import bad_request


def decode_upload(data: bytes, filename: str | None, sample_rate: int) -> np.ndarray:
    """[num_samples] float32 at ``sample_rate``."""
    from enc2dec.engine.whisper.audio import AudioError, resample, to_mono

    name = filename or "the upload"
    if not data:
        raise bad_request(f"{name} is empty", "file")
    try:
        import soundfile
    except ImportError:
        raise bad_request("this server cannot decode audio: it needs soundfile (pip install 'enc2dec[audio]')",
                          "file") from None
    try:
        frames, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)   # [frames, channels]
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types for bad input
        raise bad_request(f"cannot decode {name} as audio (WAV, FLAC, OGG, Opus or MP3): "
                          f"{str(e).split(': ')[-1] or type(e).__name__}", "file") from None
    if frames.size == 0:
        raise bad_request(f"{name} holds no audio samples", "file")
    try:
        wave = resample(to_mono(frames), int(rate), sample_rate)
    except AudioError as e:
        raise bad_request(str(e), "file") from None
    if not np.isfinite(wave).all():
        raise bad_request(f"{name} holds NaN or infinite samples", "file")
    return wave
