"""Audio workloads for Whisper: synthetic clips, a folder of clips, or a JSONL manifest.

Every request carries its audio length in seconds, so reports can give the real-time
factor. Clips are made 16 kHz mono float32 by the engine's audio reader (the same as
transcribe, eval and serve: soundfile, soxr high quality), and cut to the first 30 s: the
engine takes at most one 30 s window per request.
"""
from __future__ import annotations

import io
import os
import wave

import numpy as np

from enc2dec.engine.whisper.audio import AudioError, resample
from enc2dec.engine.whisper.audio import read_audio as engine_read_audio

from .errors import BenchInputError
from .workloads import BenchRequest, iter_jsonl

SAMPLE_RATE = 16000
MAX_SECONDS = 30.0
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".m4a", ".opus")
_POOL = 8     # distinct synthetic clips; requests reuse them (30 s is 1.9 MB each)


def whisper_prompt(wave_16k: np.ndarray) -> dict:
    return {"prompt": "", "multi_modal_data": {"audio": [(wave_16k, SAMPLE_RATE)]}}


def _request(wave_16k: np.ndarray, output_len: int, source: str) -> BenchRequest:
    return BenchRequest(whisper_prompt(wave_16k), 0, output_len, len(wave_16k) / SAMPLE_RATE, source)


def synthetic_clip(seconds: float, seed: int) -> np.ndarray:
    """Speech-band noise with a slow envelope: log-mel features that are not all silence."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * SAMPLE_RATE))
    t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, np.pi))
    tone = np.sin(2 * np.pi * rng.uniform(120, 300) * t)
    noise = rng.standard_normal(n).astype(np.float32)
    return (0.1 * envelope * (tone + 0.3 * noise)).astype(np.float32)


def synthetic_audio_requests(num: int, seconds: float, output_lens: list[int], seed: int) -> list[BenchRequest]:
    if not 0 < seconds <= MAX_SECONDS:
        raise BenchInputError(f"--audio-seconds must be in (0, {MAX_SECONDS:g}], got {seconds}")
    pool = [synthetic_clip(seconds, seed + i) for i in range(min(num, _POOL))]
    return [_request(pool[i % len(pool)], output_lens[i], f"synthetic clip #{i}") for i in range(num)]


def _resample(wave_in: np.ndarray, rate: int) -> np.ndarray:
    try:
        return resample(wave_in, rate, SAMPLE_RATE)
    except AudioError as e:          # no soxr: the message names the extra
        raise BenchInputError(str(e)) from None


def read_audio(path: str) -> np.ndarray:
    """A file as 16 kHz mono float32, at most its first 30 s (only those are decoded)."""
    if not os.path.isfile(path):
        raise BenchInputError(f"audio file not found: {path}")
    try:
        wave_16k = engine_read_audio(path, SAMPLE_RATE, MAX_SECONDS, cut=True)
    except AudioError as e:
        if e.kind == "empty audio":
            raise BenchInputError(f"audio file {path} is empty") from None
        raise BenchInputError(f"cannot read audio file {path}: {e}") from None
    return wave_16k[:int(MAX_SECONDS * SAMPLE_RATE)]


def request_from_audio_item(item, output_len: int, where: str) -> BenchRequest:
    """A Hugging Face audio cell ({"array", "sampling_rate"} or {"path"}) or a file path."""
    if isinstance(item, str):
        return _request(read_audio(item), output_len, where)
    if isinstance(item, dict) and item.get("array") is not None and item.get("sampling_rate"):
        mono = np.asarray(item["array"], dtype=np.float32)
        if mono.ndim == 2:
            mono = mono.mean(axis=0 if mono.shape[0] < mono.shape[1] else 1)
        clip = _resample(mono, int(item["sampling_rate"]))[:int(MAX_SECONDS * SAMPLE_RATE)]
        if clip.size == 0:
            raise BenchInputError(f"{where}: the audio is empty")
        return _request(clip, output_len, where)
    if isinstance(item, dict) and item.get("path"):
        return _request(read_audio(item["path"]), output_len, where)
    # datasets >= 4 decodes audio to an AudioDecoder object
    if hasattr(item, "get_all_samples"):
        samples = item.get_all_samples()
        return request_from_audio_item({"array": samples.data.numpy(), "sampling_rate": samples.sample_rate},
                                       output_len, where)
    raise BenchInputError(f"{where}: the audio field holds {type(item).__name__}; expected "
                          "{'array', 'sampling_rate'} or a file path")


def audio_dir_requests(folder: str, output_len: int, limit: int | None = None) -> list[BenchRequest]:
    if not os.path.isdir(folder):
        raise BenchInputError(f"--audio-dir {folder} is not a folder")
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(AUDIO_EXTENSIONS))
    if not names:
        raise BenchInputError(f"--audio-dir {folder} holds no audio files ({', '.join(AUDIO_EXTENSIONS)})")
    names = names[:limit] if limit else names
    return [_request(read_audio(os.path.join(folder, n)), output_len, os.path.join(folder, n)) for n in names]


def audio_manifest_requests(path: str, output_len: int, limit: int | None = None) -> list[BenchRequest]:
    """JSONL rows with ``audio`` (or ``audio_filepath`` / ``path``), relative to the manifest's
    folder, and optionally ``output_tokens``."""
    base = os.path.dirname(os.path.abspath(path))
    requests = []
    for where, row in iter_jsonl(path, "audio manifest"):
        if not isinstance(row, dict):
            raise BenchInputError(f"{where}: expected a JSON object")
        rel = row.get("audio") or row.get("audio_filepath") or row.get("path")
        if not isinstance(rel, str):
            raise BenchInputError(f"{where}: needs 'audio' (a file path relative to the manifest)")
        out_len = row.get("output_tokens", output_len)
        if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
            raise BenchInputError(f"{where}: 'output_tokens' must be an integer >= 1, got {out_len!r}")
        clip_path = rel if os.path.isabs(rel) else os.path.join(base, rel)
        try:
            requests.append(_request(read_audio(clip_path), out_len, where))
        except BenchInputError as e:
            raise BenchInputError(f"{where}: {e}") from None
        if limit and len(requests) >= limit:
            break
    if not requests:
        raise BenchInputError(f"audio manifest {path} holds no rows")
    return requests


def wav_bytes(wave_16k: np.ndarray) -> bytes:
    """16-bit PCM WAV, for uploading to /v1/audio/transcriptions."""
    pcm = (np.clip(wave_16k, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    return buf.getvalue()
