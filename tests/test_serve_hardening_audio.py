"""A server one bad client cannot break, part 3: audio whose header claims far more than the
server allows is refused before it is decoded, and decoding never goes past the limit, so
memory stays proportional to --max-audio-s (tiny random Whisper, loopback)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import wave

import numpy as np
import pytest
from test_serve_helpers import LiveServer, ServeConfig, httpx, tiny_llm_factory, tone, wav_bytes

soundfile = pytest.importorskip("soundfile")

NAME = "whisper-1"
MEMORY_BOUND_MB = 200


def ten_hz_wav() -> bytes:
    """600 kB of 16-bit samples whose header says 10 Hz: 30,000 s (3.3 GB once resampled to 16 kHz)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(10)
        w.writeframes(np.zeros(300_000, "<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def silence_3h(tmp_path_factory) -> str:
    """3 h of 16 kHz silence: a 546 kB FLAC that decodes to 691 MB of float32."""
    path = str(tmp_path_factory.mktemp("audio") / "silence-3h.flac")
    block = np.zeros(16000 * 600, np.int16)
    with soundfile.SoundFile(path, "w", samplerate=16000, channels=1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(18):
            f.write(block)
    return path


@pytest.fixture(scope="module")
def server(whisper):
    cfg = ServeConfig(model=whisper, served_model_names=(NAME,), max_upload_bytes=2 << 20, max_audio_s=3600.0)
    srv = LiveServer(cfg, tiny_llm_factory(whisper, max_input_len=1500, max_num_tokens=4096,
                                           max_batch_size=8)).start()
    yield srv
    srv.stop()


def transcribe(server, name: str, data: bytes):
    return httpx.post(server.url + "/v1/audio/transcriptions", files={"file": (name, data)},
                      data={"model": NAME, "language": "en", "max_tokens": "4", "ignore_eos": "true"}, timeout=60)


def test_3_uploads_claiming_hours_are_refused_from_the_header(server, silence_3h):
    good = wav_bytes(tone(1.0))
    with open(silence_3h, "rb") as f:
        flac = f.read()
    for name, data, seconds in (("ten-hz.wav", ten_hz_wav(), "30000.0 s"), ("silence.flac", flac, "10800.0 s")):
        t0 = time.monotonic()
        r = transcribe(server, name, data)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "audio_too_long" and err["param"] == "file"
        assert seconds in err["message"] and "--max-audio-s" in err["message"]
        assert time.monotonic() - t0 < 5
        ok = transcribe(server, "good.wav", good)                  # and the next request is served
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 4, ok.text


_PEAK = """
import json, resource, sys
from enc2dec.engine.whisper.audio import read_audio
from enc2dec.serve.audio_input import decode_upload
from enc2dec.serve.errors import APIError
sys.path.insert(0, sys.argv[2])
from test_serve_hardening_audio import ten_hz_wav
uploads = [ten_hz_wav(), open(sys.argv[1], "rb").read()]
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak_mb()
codes = []
for data in uploads:
    try:
        decode_upload(data, "upload", 16000, 3600.0)
    except APIError as e:
        codes.append(e.code)
head = read_audio(sys.argv[1], 16000, 30.0, cut=True)     # bench and eval: the first 30 s only
print(json.dumps({"base": base, "peak": peak_mb(), "codes": codes, "head_s": len(head) / 16000}))
"""


def test_3_rejecting_them_costs_bounded_memory(silence_3h):
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _PEAK, silence_3h, tests], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["codes"] == ["audio_too_long", "audio_too_long"] and got["head_s"] == 30.0
    assert got["peak"] - got["base"] < MEMORY_BOUND_MB, got
