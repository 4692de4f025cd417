"""Audio files as model input: whatever libsndfile reads, mixed to mono, resampled with soxr.

soundfile (libsndfile: wav, flac, ogg/vorbis/opus, mp3 from libsndfile 1.1 on, aiff, ...)
and soxr are the optional ``audio`` extra, imported when first needed. Every failure is an
``AudioError`` naming the file, so a caller can report it and go on with the next one.
"""
from __future__ import annotations

import os

import numpy as np

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".aifc", ".au",
                    ".caf", ".w64", ".rf64")
_INSTALL_HINT = "pip install 'enc2dec[audio]'"


class AudioError(ValueError):
    """A file that cannot be used as audio (missing, unreadable, corrupt, empty)."""


def _soundfile():
    try:
        import soundfile
    except ImportError:
        raise AudioError(f"reading audio files needs soundfile: {_INSTALL_HINT}") from None
    except OSError as e:          # the wheel is there but libsndfile failed to load
        raise AudioError(f"soundfile cannot load libsndfile ({e}); reinstall it: {_INSTALL_HINT}") from None
    return soundfile


def _open_error(path: str, e: Exception) -> AudioError:
    reason = str(e).split(": ", 1)[-1] if str(e).startswith("Error opening") else str(e)
    return AudioError(f"cannot read {path}: {reason.strip() or type(e).__name__} (the file is corrupt or in a "
                      "format libsndfile does not read; it reads wav, flac, ogg, opus and mp3)")


def probe_duration_s(path: str) -> float:
    """The length in seconds from the file's header, without decoding it."""
    if not os.path.isfile(path):
        raise AudioError(f"{path}: no such file")
    sf = _soundfile()
    try:
        info = sf.info(path)
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise _open_error(path, e) from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise AudioError(f"{path} holds no audio samples")
    return info.frames / info.samplerate


def resample(wave: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling (soxr's high quality); a no-op at the same rate."""
    if rate_in == rate_out:
        return wave
    try:
        import soxr
    except ImportError:
        raise AudioError(f"audio at {rate_in} Hz must be resampled to {rate_out} Hz, which needs soxr: "
                         f"{_INSTALL_HINT}") from None
    return soxr.resample(wave, rate_in, rate_out, quality="HQ").astype(np.float32, copy=False)


def to_mono(data: np.ndarray) -> np.ndarray:
    """[frames] or [frames, channels] -> [frames] float32, channels averaged."""
    data = np.asarray(data, dtype=np.float32)
    if data.ndim == 2:
        data = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if data.ndim != 1:
        raise AudioError(f"audio must be [frames] or [frames, channels], got shape {data.shape}")
    return np.ascontiguousarray(data)


def load_audio(path: str, sample_rate: int) -> np.ndarray:
    """A file as mono float32 at ``sample_rate``: [num_samples]."""
    if not os.path.isfile(path):
        raise AudioError(f"{path}: no such file")
    sf = _soundfile()
    try:
        data, rate = sf.read(path, dtype="float32", always_2d=True)    # [frames, channels]
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise _open_error(path, e) from None
    if data.size == 0:
        raise AudioError(f"{path} holds no audio samples")
    wave = resample(to_mono(data), int(rate), sample_rate)
    if not np.isfinite(wave).all():
        raise AudioError(f"{path} holds NaN or infinite samples")
    return wave


def expand_inputs(paths: list[str]) -> tuple[list[str], list[str]]:
    """Files as given and the audio files under folders (recursively, sorted), plus the
    problems found: paths that do not exist and folders without audio files."""
    files, problems = [], []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(p) for name in names
                           if name.lower().endswith(AUDIO_EXTENSIONS))
            if not found:
                problems.append(f"{p}: the folder holds no audio files ({', '.join(AUDIO_EXTENSIONS)})")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            problems.append(f"{p}: no such file or folder")
    return list(dict.fromkeys(files)), problems
