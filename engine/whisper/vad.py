"""The vad strategy's plan: speech regions from Silero VAD, packed into windows of at most
30 s of speech, and the map from a window's seconds back to the file's.

Silence between regions is left out of the windows, so the model never decodes a window
that holds no speech (where Whisper invents text) and a window carries up to 30 s of
speech. ``silero-vad`` (with onnxruntime: in the ``audio`` extra) is imported only when a
file over 30 s is planned; the packing and the time map are plain numbers, unit tested without it.
"""
from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import dataclass

import numpy as np

VAD_SAMPLE_RATE = 16000
# As faster-whisper's batched pipeline sets Silero up: regions split at pauses of 160 ms
# (a sentence boundary, not a breath inside a word), none longer than a window.
MIN_SILENCE_MS = 160
SPEECH_PAD_MS = 400         # speech kept either side of a region: onsets and word tails Silero scores low
SEAM_SNAP_S = 1.0           # about the silence around a seam: two pads
INSTALL_COMMAND = 'pip install "enc2dec[audio]"'
INSTALL_HINT = (f'the vad strategy (the default for audio over 30 s) needs silero-vad and onnxruntime: '
                f'{INSTALL_COMMAND}, or pass strategy="chunked" or "sequential"')


@dataclass(frozen=True)
class VadWindow:
    """Speech regions of the file, as (start, end) sample ranges in order, decoded as one window."""

    regions: tuple[tuple[int, int], ...]

    @property
    def num_samples(self) -> int:
        return sum(e - s for s, e in self.regions)

    def audio(self, wave: np.ndarray) -> np.ndarray:
        return np.concatenate([wave[s:e] for s, e in self.regions])

    def to_file_s(self, offset_s: float, sample_rate: int, is_end: bool = False) -> float:
        """The file's time of a point ``offset_s`` into the window. A point on the seam of two
        regions belongs to the one before when it ends a segment, to the one after when it starts one."""
        ends = np.cumsum([e - s for s, e in self.regions])            # [num_regions]
        x = min(max(offset_s * sample_rate, 0.0), float(ends[-1]))
        k = bisect.bisect_left(ends, x) if is_end else bisect.bisect_right(ends, x)
        k = min(k, len(self.regions) - 1)
        before = ends[k - 1] if k else 0
        return (self.regions[k][0] + x - before) / sample_rate

    def span_to_file_s(self, start_s: float, end_s: float, sample_rate: int) -> tuple[float, float]:
        """A segment's (start, end) in the file. Whisper puts a boundary anywhere in the pause a
        seam sits in, so a segment that crosses a seam by less than ``SEAM_SNAP_S`` is moved off it:
        otherwise it would start at the end of one region and stretch over the silence left out."""
        seams = np.cumsum([e - s for s, e in self.regions])[:-1] / sample_rate    # [num_regions - 1]
        ahead = [x for x in seams if start_s < x < end_s]
        if ahead and ahead[0] - start_s < SEAM_SNAP_S:
            start_s = float(ahead[0])
        behind = [x for x in seams if start_s < x < end_s]
        if behind and end_s - behind[-1] < SEAM_SNAP_S:
            end_s = float(behind[-1])
        return self.to_file_s(start_s, sample_rate), self.to_file_s(end_s, sample_rate, is_end=True)


def pack_windows(regions: list[tuple[int, int]], max_samples: int) -> list[VadWindow]:
    """Consecutive regions gathered greedily into windows of at most ``max_samples``; a region
    longer than that (Silero's own cap should prevent it) is cut into window-sized pieces."""
    pieces = [(s, min(s + max_samples, end)) for start, end in regions for s in range(start, end, max_samples)]
    windows, current, size = [], [], 0
    for s, e in pieces:
        if current and size + (e - s) > max_samples:
            windows.append(VadWindow(tuple(current)))
            current, size = [], 0
        current.append((s, e))
        size += e - s
    if current:
        windows.append(VadWindow(tuple(current)))
    return windows


def check_available() -> None:
    """Raise ``ValueError`` naming the extra when silero-vad or onnxruntime is missing."""
    import importlib.util

    if importlib.util.find_spec("silero_vad") is None or importlib.util.find_spec("onnxruntime") is None:
        raise ValueError(INSTALL_HINT)


_MODEL_LOCK = threading.Lock()


def _model():
    with _MODEL_LOCK:               # one load, also when a preload is under way
        return _load_model()


def preload_in_background() -> None:
    """Load Silero (onnxruntime's import and the model, ~0.2 s on two cores) on a daemon thread,
    e.g. while the engine loads its checkpoint, instead of inside the first long file's
    transcription. A missing package is left to ``speech_regions`` to report."""
    def load() -> None:
        try:
            _model()
        except ValueError:
            pass

    threading.Thread(target=load, name="enc2dec-vad-load", daemon=True).start()


@functools.lru_cache(maxsize=1)
def _load_model():
    import torch

    # silero_vad sets torch to one thread when imported; the engine's CPU path needs its threads back.
    num_threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
        from silero_vad.sequence_vad import get_speech_timestamps_sequence
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from None
    finally:
        torch.set_num_threads(num_threads)
    # The sequence model runs the recurrent net over blocks of frames in one ONNX call: the same
    # probabilities as the frame-by-frame TorchScript model, about 8x faster on a CPU.
    return load_silero_vad(sequence=True), get_speech_timestamps_sequence


def speech_regions(wave: np.ndarray, sample_rate: int, max_region_s: float) -> list[tuple[int, int]]:
    """(start, end) sample ranges of speech in a mono 16 kHz ``wave``, padded, none longer than
    ``max_region_s``. Thread-safe: one ONNX session, no state kept between calls."""
    if sample_rate != VAD_SAMPLE_RATE:
        raise ValueError(f"Silero VAD runs on {VAD_SAMPLE_RATE} Hz audio, got {sample_rate} Hz")
    model, timestamps = _model()
    found = timestamps(np.ascontiguousarray(wave, dtype=np.float32), model, sampling_rate=sample_rate,
                       max_speech_duration_s=max_region_s, min_silence_duration_ms=MIN_SILENCE_MS,
                       speech_pad_ms=SPEECH_PAD_MS)
    return [(int(r["start"]), int(r["end"])) for r in found]
