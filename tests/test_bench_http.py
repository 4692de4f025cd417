"""bench --url against a tiny OpenAI-compatible stub server, and the audio workloads.

The stub runs on 127.0.0.1 in a thread, streams one SSE chunk per token, and shuts itself
down after at most a minute whatever happens to the test.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from enc2dec.bench import audio
from enc2dec.bench.errors import BenchInputError
from enc2dec.cli.main import app
from typer.testing import CliRunner

pytest.importorskip("httpx")


class _Stub(BaseHTTPRequestHandler):
    seen: list = []
    loading_until = 0.0        # until this time.monotonic(), 503 "loading" as enc2dec serve answers
    health = None              # a fixed /health answer (code, body) instead

    def _loading(self) -> bool:
        if time.monotonic() >= self.loading_until:
            return False
        self._json(503, {"status": "loading"} if self.path == "/health" else
                   {"error": {"message": "the model is still loading; retry shortly"}})
        return True

    def log_message(self, *args):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health" and self.health is not None:
            return self._json(*self.health)
        if self._loading():
            return
        self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self._loading():
            return
        if self.path == "/v1/audio/transcriptions":
            n = int(re.search(rb'name="max_tokens"\r\n\r\n(\d+)', raw).group(1))
            self.seen.append(("audio", n))
            return self._json(200, {"text": "hi", "usage": {"type": "tokens", "output_tokens": n}})
        body = json.loads(raw)
        self.seen.append(("text", body))
        if body["prompt"][0] == 13:
            return self._json(500, {"error": {"message": "stub failure"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(0.002)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stub_url():
    pytest.importorskip("httpx")
    _Stub.seen, _Stub.loading_until, _Stub.health = [], 0.0, None
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    killer = threading.Timer(60, server.shutdown)      # bounded whatever the test does
    killer.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    killer.cancel()
    server.shutdown()
    server.server_close()


def bench_cli(*args):
    return CliRunner().invoke(app, ["bench", "--quiet", *args])


def test_url_bench_text(stub_url, tmp_path):
    out = tmp_path / "r.json"
    r = bench_cli("--url", stub_url + "/v1", "--concurrency", "1,3", "--num-requests", "6", "--input-len", "5",
                  "--output-len", "4", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["model"] == "stub-model" and rep["device"]["target"] == stub_url + "/v1"
    for lv in rep["levels"]:
        assert lv["backend"] == "http" and lv["completed"] == 6 and lv["output_tokens"] == 24
        assert lv["input_tokens"] == 30
        assert lv["p50_ttft_ms"] <= lv["p99_ttft_ms"] <= lv["p99_e2e_ms"] and lv["mean_itl_ms"] > 0
    sent = [b for kind, b in _Stub.seen if kind == "text"]
    assert all(b["ignore_eos"] and b["stream"] and b["max_tokens"] == 4 and b["temperature"] == 0 for b in sent)


def test_url_bench_from_two_client_processes_counts_every_request_once(stub_url, tmp_path):
    out = tmp_path / "r.json"
    r = bench_cli("--url", stub_url, "--concurrency", "4", "--num-requests", "10", "--warmup", "1",
                  "--input-len", "5", "--output-len", "3", "--client-processes", "2", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    lv = rep["levels"][0]
    assert rep["client_processes"] == 2
    assert lv["completed"] == 10 and lv["failed"] == 0 and lv["output_tokens"] == 30 and lv["duration_s"] > 0
    # The stub saw the warm-up wave (C requests) and the level's 10, from both processes together.
    assert len([b for kind, b in _Stub.seen if kind == "text"]) == 4 + 10
    # How busy the client processes were, so a client-bound figure shows as one.
    assert 0 < lv["client_cpu_frac"] <= 1.5 and lv["client_lag_ms"] >= 0 and lv["client_lag_p99_ms"] >= 0
    r = bench_cli("--model", "google/flan-t5-small", "--load-format", "dummy", "--client-processes", "2")
    assert r.exit_code == 2 and "--client-processes is for --url" in r.output


def test_url_bench_keeps_prompt_ids_inside_a_local_models_vocabulary(stub_url, tmp_path):
    # --model names the served checkpoint's folder: its vocabulary bounds the synthetic ids (a
    # server of a small-vocabulary model refuses ids past it with 400s).
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 88}))
    r = bench_cli("--url", stub_url, "--model", str(folder), "--concurrency", "2", "--num-requests", "8",
                  "--input-len", "16", "--output-len", "2")
    assert r.exit_code == 0, r.output
    ids = [t for kind, b in _Stub.seen if kind == "text" for t in b["prompt"]]
    assert len(ids) >= 8 * 16 and max(ids) < 88 and len(set(ids)) > 10


def test_url_failed_requests_exit_1(stub_url, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [13, 2], "output_tokens": 2}\n{"input_ids": [3, 2], "output_tokens": 2}\n')
    r = bench_cli("--url", stub_url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                  "--dataset", str(data))
    assert r.exit_code == 1 and "HTTP 500" in r.output


def test_url_audio(stub_url):
    r = bench_cli("--url", stub_url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                  "--audio-seconds", "1.5", "--output-len", "7", "--fail-under", "rtf=0.1")
    assert r.exit_code == 0, r.output
    assert [n for kind, n in _Stub.seen if kind == "audio"] == [7] * 4


def test_url_bench_waits_for_a_server_still_loading_its_model(stub_url, tmp_path):
    # A script starts the server in the background and benches it at once: the server listens
    # but answers 503 "loading" (to /health and to requests) until its model is up.
    out = tmp_path / "r.json"
    _Stub.loading_until = time.monotonic() + 1.5
    r = bench_cli("--url", stub_url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                  "--input-len", "4", "--output-len", "2", "--report-json", str(out))
    assert r.exit_code == 0, r.output
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["completed"] == 4 and lv["failed"] == 0
    assert time.monotonic() >= _Stub.loading_until
    # Past --ready-timeout it gives up with the reason (exit 2), before sending any request.
    _Stub.seen, _Stub.loading_until = [], time.monotonic() + 30
    r = bench_cli("--url", stub_url, "--concurrency", "1", "--num-requests", "2", "--ready-timeout", "1")
    assert r.exit_code == 2 and "still loading its model after 1 s (--ready-timeout)" in r.output, r.output
    assert _Stub.seen == []
    # A server whose engine failed is an error at once, with the server's words.
    _Stub.health = (503, {"status": "failed", "error": "RuntimeError: CUDA out of memory"})
    t0 = time.monotonic()
    r = bench_cli("--url", stub_url, "--concurrency", "1", "--num-requests", "2")
    assert r.exit_code == 2 and "the server's engine failed: RuntimeError: CUDA out of memory" in r.output
    assert time.monotonic() - t0 < 10
    r = bench_cli("--model", "google/flan-t5-small", "--load-format", "dummy", "--ready-timeout", "5")
    assert r.exit_code == 2 and "--ready-timeout is for --url" in r.output


def test_unreachable_url_exit_2():
    pytest.importorskip("httpx")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = bench_cli("--url", f"http://127.0.0.1:{port}", "--concurrency", "1")
    assert r.exit_code == 2 and "cannot reach" in r.output and "Traceback" not in r.output
    r = bench_cli("--url", "localhost:8000", "--concurrency", "1")
    assert r.exit_code == 2 and "http://" in r.output


# ---- audio workloads ------------------------------------------------------------------------------
def _write_wav(path, seconds, rate, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    data = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(data, channels).tobytes())


def test_synthetic_clips_carry_their_seconds():
    reqs = audio.synthetic_audio_requests(10, 2.5, [5] * 10, seed=1)
    assert all(r.is_audio and r.audio_s == 2.5 and r.input_len == 0 for r in reqs)
    wave_ = reqs[0].prompt["multi_modal_data"]["audio"][0][0]
    assert wave_.dtype == np.float32 and len(wave_) == 40000 and 0 < np.abs(wave_).max() <= 1
    with pytest.raises(BenchInputError, match="--audio-seconds"):
        audio.synthetic_audio_requests(1, 31, [5], seed=1)


def test_audio_files_folder_and_manifest(tmp_path):
    _write_wav(tmp_path / "a.wav", 2.0, 8000, channels=2)      # stereo 8 kHz: mixed down, resampled
    _write_wav(tmp_path / "b.wav", 40.0, 16000)                 # cut to 30 s
    (tmp_path / "notes.txt").write_text("not audio")
    (tmp_path / "empty").mkdir()
    reqs = audio.audio_dir_requests(str(tmp_path), output_len=6)
    assert [round(r.audio_s, 3) for r in reqs] == [2.0, 30.0] and all(r.output_len == 6 for r in reqs)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"audio": "a.wav", "output_tokens": 3}\n{"audio_filepath": "b.wav"}\n')
    assert [r.output_len for r in audio.audio_manifest_requests(str(manifest), 9)] == [3, 9]
    manifest.write_text('{"audio": "a.wav"}\n{"audio": "missing.wav"}\n')
    with pytest.raises(BenchInputError, match=r"m.jsonl line 2: audio file not found"):
        audio.audio_manifest_requests(str(manifest), 9)
    (tmp_path / "bad.wav").write_bytes(b"RIFF0000WAVEjunk")
    with pytest.raises(BenchInputError, match="cannot read audio file"):
        audio.read_audio(str(tmp_path / "bad.wav"))
    with pytest.raises(BenchInputError, match="no audio files"):
        audio.audio_dir_requests(str(tmp_path / "m.jsonl").replace("m.jsonl", "empty"), 1)


def test_wav_bytes_round_trip(tmp_path):
    clip = audio.synthetic_clip(1.0, seed=3)
    path = tmp_path / "x.wav"
    path.write_bytes(audio.wav_bytes(clip))
    back = audio.read_audio(str(path))
    assert len(back) == 16000 and np.allclose(back, clip, atol=1e-3)
