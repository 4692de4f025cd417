"""Helpers for the serve tests (no tests here): a real uvicorn server on 127.0.0.1 in a
background thread, and small builders. Every wait is bounded."""
from __future__ import annotations

import functools
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
    # serve's default: the engine core in its own process
    options = dict(dtype="float32", max_batch_size=16, max_input_len=64, kv_cache_config=KV, engine_process=True)
    options.update(kw)
    return lambda: LLM(model, **options)


def _fail_next_steps(core, count: int, message: str) -> None:
    runner = core.runner
    name = "launch" if hasattr(runner, "launch") else "execute"     # the runner's per-step entry point
    real, left = getattr(runner, name), [count]

    def flaky(so):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(message)
        return real(so)

    setattr(runner, name, flaky)


def fail_next_steps(llm, count: int = 1, message: str = "injected device fault") -> None:
    """The engine's next ``count`` steps raise ``message`` (in the engine process, if it has one:
    a module-level function crosses the boundary)."""
    llm.call_on_engine(functools.partial(_fail_next_steps, count=count, message=message)).result(timeout=30)


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


class RawConnection:
    """One keep-alive TCP connection speaking HTTP/1.1 by hand: for framing the clients refuse to
    send, and to see whether the server keeps or closes the connection."""

    def __init__(self, port: int, timeout_s: float = 30.0):
        import socket

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> None:
        head = {"Host": "127.0.0.1", **({"Content-Type": "application/json"} if body is not None else {}),
                **({"Content-Length": str(len(body))} if body is not None else {}), **(headers or {})}
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
        self.send("\r\n".join(lines).encode() + (body or b""))

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response (Content-Length or chunked body): status, headers (lower-case), body."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError("closed before a response")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                if not self._fill():
                    raise ConnectionError("closed mid-body")
            body, self.buf = self.buf[:n], self.buf[n:]
        else:
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    self._fill()
                size_line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(self.buf) < size + 2:
                    self._fill()
                body, self.buf = body + self.buf[:size], self.buf[size + 2:]
                if size == 0:
                    break
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self, timeout_s: float = 5.0) -> bool:
        """True once the server closes its end (reads return EOF) within ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()
