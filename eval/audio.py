"""Audio for the Whisper tasks: any clip a dataset row can hold, made 16 kHz mono float32.

A row's audio is a file path (relative to the manifest's folder), a Hugging Face ``Audio``
value (``{"array", "sampling_rate"}`` decoded, or ``{"path", "bytes"}`` undecoded) or a
decoder object with ``get_all_samples()``. Files and bytes are read and every clip is
resampled by the project's one audio reader (``enc2dec.engine.whisper.audio``: soundfile
and soxr, the same as ``transcribe`` and ``serve``), so they all hear the same input.
"""
from __future__ import annotations

import os

import numpy as np

# The project's one audio reader and its one input-error type (``kind`` sorts the bad rows).
from enc2dec.engine.whisper.audio import AudioError, read_audio
from enc2dec.engine.whisper.audio import resample as engine_resample

__all__ = ["AudioError", "MAX_SECONDS", "SAMPLE_RATE", "load_clip", "resample"]

SAMPLE_RATE = 16000
MAX_SECONDS = 30.0     # the engine takes one 30 s window per request
_LONG_HINT = " per request (cut it, or use enc2dec transcribe for long audio)"


def _read(source, name: str) -> tuple[np.ndarray, int]:
    """A file or its bytes through the engine's reader, decoding at most the 30 s allowed."""
    return read_audio(source, SAMPLE_RATE, MAX_SECONDS, name=name, hint=_LONG_HINT), SAMPLE_RATE


def _decode(value, base_dir: str) -> tuple[np.ndarray, int]:
    if isinstance(value, str):
        path = value if os.path.isabs(value) else os.path.join(base_dir, value)
        if not os.path.isfile(path):
            raise AudioError(f"no such file: {path}")
        return _read(path, path)
    if isinstance(value, dict):
        if value.get("array") is not None:
            if value.get("sampling_rate") is None:
                raise AudioError("an audio mapping with 'array' needs 'sampling_rate'")
            return np.asarray(value["array"], dtype=np.float32), int(value["sampling_rate"])
        if value.get("bytes"):
            return _read(value["bytes"], value.get("path") or "the audio bytes")
        if value.get("path"):
            return _decode(value["path"], base_dir)
        raise AudioError("an audio mapping needs 'array' and 'sampling_rate', 'bytes' or 'path'")
    if hasattr(value, "get_all_samples"):     # datasets >= 4 decodes through torchcodec
        samples = value.get_all_samples()
        return samples.data.numpy().astype(np.float32), int(samples.sample_rate)
    raise AudioError(f"not an audio value: {type(value).__name__}")


def resample(wave: np.ndarray, rate: int) -> np.ndarray:
    return engine_resample(wave, rate, SAMPLE_RATE)


def load_clip(value, base_dir: str = ".") -> np.ndarray:
    """A row's audio as a 16 kHz mono float32 wave; raises ``AudioError`` for what cannot be used."""
    wave, rate = _decode(value, base_dir)
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 2:      # soundfile gives [frames, channels], torchcodec [channels, frames]
        wave = wave.mean(axis=1 if wave.shape[0] > wave.shape[1] else 0)
    if wave.ndim != 1 or wave.size == 0:
        raise AudioError("the clip is empty", kind="empty audio")
    if rate <= 0:
        raise AudioError(f"bad sampling rate {rate}")
    wave = resample(wave, rate)
    if not np.isfinite(wave).all():
        raise AudioError("the clip holds NaN or infinite samples")
    seconds = len(wave) / SAMPLE_RATE
    if seconds > MAX_SECONDS + 1e-3:
        raise AudioError(f"the clip is {seconds:.1f} s long; the engine takes at most {MAX_SECONDS:g} s "
                         "per request (cut it, or use enc2dec transcribe for long audio)",
                         kind="audio too long")
    return wave
