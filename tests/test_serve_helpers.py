"""Helpers for the serve tests (no tests here): a real uvicorn server on 127.0.0.1 in a
background thread, and small builders. Every wait is bounded."""
from __future__ import annotations

import io
import threading
import time
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from enc2dec.engine import LLM, KvCacheConfig
from enc2dec.serve.app import build_app
from enc2dec.serve.config import ServeConfig
from enc2dec.serve.server import bind_socket, make_server

KV = KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4, max_cpu_memory_bytes=32 << 20)


def tiny_llm_factory(model: str, **kw):
    options = dict(dtype="float32", max_batch_size=16, max_input_len=64, kv_cache_config=KV)
    options.update(kw)
    return lambda: LLM(model, **options)


class LiveServer:
    """``build_app`` + uvicorn on an ephemeral loopback port, in a daemon thread."""

    def __init__(self, config: ServeConfig, make_llm):
        self.config = config
        self.app = build_app(config, make_llm)
        self._sock = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def front(self):
        return self.app.state.front

    @property
    def llm(self):
        return self.front.llm

    def start(self, wait_ready: bool = True, timeout_s: float = 90.0) -> LiveServer:
        """Starts the thread (once) and waits for /health: 200, or any answer unless ``wait_ready``."""
        if not self.thread.is_alive():
            self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                if r.status_code == 200 or (not wait_ready and r.status_code == 503):
                    return self
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"engine failed: {r.json()}")
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server on {self.url} not ready within {timeout_s} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self._sock.close()

    def metrics(self, headers=None) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Metrics once nothing is in flight and both KV pools are empty (or the last look)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m.get("enc2dec_num_requests_in_flight") == 0 and m.get("enc2dec_num_requests_running") == 0
                    and m.get("enc2dec_num_requests_waiting") == 0
                    and m.get('enc2dec_kv_blocks_used{pool="self"}') == 0
                    and m.get('enc2dec_kv_blocks_used{pool="cross"}') == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    if channels > 1:
        pcm = np.repeat(pcm[:, None], channels, axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
