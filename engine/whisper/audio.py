"""Audio files as model input: whatever libsndfile reads, mixed to mono, resampled with soxr.

The project's one audio reader: transcribe, serve, bench and eval all read through
``read_audio``. soundfile (libsndfile: wav, flac, ogg/vorbis/opus, mp3 from libsndfile 1.1
on, aiff, ...) and soxr are the optional ``audio`` extra, imported when first needed. Every
failure is an ``AudioError`` naming the file, so a caller can report it and go on with the
next one.

A length limit is checked from the header before anything is decoded, and decoding stops
at the limit whatever the header claims, so memory stays proportional to the allowed
duration (a small file can claim hours of audio, or a 10 Hz rate that resamples to gigabytes).
"""
from __future__ import annotations

import io
import math
import os

import numpy as np

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".aifc", ".au",
                    ".caf", ".w64", ".rf64")
_INSTALL_HINT = "pip install 'enc2dec[audio]'"


class AudioError(ValueError):
    """A file that cannot be used as audio (missing, unreadable, corrupt, empty, too long).
    ``kind`` sorts the problem for reports: ``unreadable audio``, ``empty audio`` or
    ``audio too long``."""

    def __init__(self, message: str, kind: str = "unreadable audio"):
        super().__init__(message)
        self.kind = kind


def too_long(name: str, seconds: float, max_seconds: float, hint: str = "") -> AudioError:
    return AudioError(f"{name} is {seconds:.1f} s long; at most {max_seconds:g} s is allowed{hint}",
                      kind="audio too long")


def _soundfile():
    try:
        import soundfile
    except ImportError:
        raise AudioError(f"reading audio files needs soundfile: {_INSTALL_HINT}") from None
    except OSError as e:          # the wheel is there but libsndfile failed to load
        raise AudioError(f"soundfile cannot load libsndfile ({e}); reinstall it: {_INSTALL_HINT}") from None
    return soundfile


def _open_error(path: str, e: Exception, verb: str = "read {}") -> AudioError:
    reason = str(e).split(": ", 1)[-1] if str(e).startswith("Error opening") else str(e)
    return AudioError(f"cannot {verb.format(path)}: {reason.strip() or type(e).__name__} (the file is corrupt "
                      "or in a format libsndfile does not read; it reads wav, flac, ogg, opus and mp3)")


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


def load_audio(path: str, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """A file as mono float32 at ``sample_rate``: [num_samples]."""
    if not os.path.isfile(path):
        raise AudioError(f"{path}: no such file")
    return read_audio(path, sample_rate, max_seconds)


def read_audio(source, sample_rate: int, max_seconds: float | None = None, name: str | None = None,
               cut: bool = False, hint: str = "") -> np.ndarray:
    """``source`` (a path, bytes or a binary file object) as mono float32 at ``sample_rate``.

    ``max_seconds``: longer audio is an ``AudioError`` (kind ``audio too long``), known from
    the header when it says so and otherwise at the first frame past the limit; with ``cut``
    the first ``max_seconds`` are kept instead. Either way at most that much is decoded."""
    sf = _soundfile()
    name = name or (source if isinstance(source, str) else "the audio")
    verb = "read {}" if isinstance(source, str) else "decode {} as audio"
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    try:
        info = sf.info(source)
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise _open_error(name, e, verb) from None
    finally:
        if hasattr(source, "seek"):
            source.seek(0)
    rate = int(info.samplerate)
    if rate <= 0:
        raise AudioError(f"{name} has no valid sample rate")
    limit = -1
    if max_seconds is not None:
        if not cut and info.frames > 0 and info.frames / rate > max_seconds:
            raise too_long(name, info.frames / rate, max_seconds, hint)
        limit = int(math.ceil(max_seconds * rate)) + (0 if cut else 1)    # one past the limit: it lies
    try:
        data, rate = sf.read(source, frames=limit, dtype="float32", always_2d=True)   # [frames, channels]
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise _open_error(name, e, verb) from None
    if data.size == 0:
        raise AudioError(f"{name} holds no audio samples", kind="empty audio")
    if max_seconds is not None and not cut and len(data) > max_seconds * rate:
        raise AudioError(f"{name} is longer than {max_seconds:g} s, the most allowed{hint} (its header "
                         "understates its length)", kind="audio too long")
    wave = resample(to_mono(data), int(rate), sample_rate)
    del data
    if not np.isfinite(wave).all():
        raise AudioError(f"{name} holds NaN or infinite samples")
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
