"""A server one bad client cannot break, part 2: HTTP framing, body and idle timeouts, and a
SIGTERM drain that ends within --drain-timeout, on loopback (tiny T5)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_serve_helpers import LiveServer, RawConnection, ServeConfig, httpx, tiny_llm_factory

GOOD = json.dumps({"prompt": "a fine request", "max_tokens": 4, "ignore_eos": True}).encode()


@pytest.fixture(scope="module")
def server(t5_relu):
    cfg = ServeConfig(model=t5_relu, max_upload_bytes=1 << 20, request_timeout_s=1.0, keep_alive_s=1.0)
    srv = LiveServer(cfg, tiny_llm_factory(t5_relu)).start()
    yield srv
    srv.stop()


def assert_serves(server):
    r = httpx.post(server.url + "/v1/completions", content=GOOD, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _chunked(data: bytes, size: int = 1 << 16) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"


def _send_quietly(conn: RawConnection, data: bytes) -> threading.Thread:
    """The server may answer and close before it has read everything: keep sending, ignore that."""
    def run():
        try:
            conn.send(data)
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_4_content_length_with_chunked_is_refused_and_the_connection_closed(server):
    body = json.dumps({"prompt": "y" * (3 << 20)}).encode()          # 3 MB on a 1 MB server
    smuggled = b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n"
    conn = RawConnection(server.port)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n")
        sender = _send_quietly(conn, head + _chunked(body) + smuggled)
        status, headers, raw = conn.response()
        assert status == 400 and json.loads(raw)["error"]["code"] == "bad_framing"
        assert headers.get("connection") == "close"
        assert conn.closed_by_server() and b"HTTP/1.1 200" not in conn.buf     # the smuggled GET: never answered
        sender.join(timeout=10)
    finally:
        conn.close()
    assert_serves(server)


class _Transport:
    """What a uvicorn protocol writes, and whether it closed the connection."""

    def __init__(self):
        self.buf, self.closed = b"", False

    def write(self, data):
        self.buf += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


@pytest.mark.parametrize("name,data,reason", [
    ("httptools", b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
     "Content-Length"),
    ("httptools", b"NOT A REQUEST\r\n\r\n", "method"),
    ("h11", b"NOT A REQUEST\r\n\r\n", "request line"),
])
def test_4_what_the_http_parser_refuses_is_answered_in_the_api_error_format(name, data, reason):
    # The server's parser is httptools (installed with the serve extra), else h11: a request that
    # either one refuses before the app sees it gets the API's JSON error, not a text/plain 400.
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from enc2dec.serve.server import http_protocol

    async def app(scope, receive, send):
        raise AssertionError("the app must not see a request the parser refused")

    async def feed():
        config = uvicorn.Config(app, log_level="error")
        config.load()
        protocol = http_protocol(name)(config=config, server_state=ServerState(), app_state={})
        transport = _Transport()
        protocol.connection_made(transport)
        protocol.data_received(data)
        await asyncio.sleep(0)
        return transport

    transport = asyncio.run(feed())
    head, _, body = transport.buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    assert b"connection: close" in head.lower() and transport.closed
    error = json.loads(body)["error"]
    assert error["code"] == "bad_framing" and reason in error["message"], error


def test_4_chunked_bodies_are_counted_whatever_the_headers_say(server):
    body = json.dumps({"prompt": "y" * (3 << 20)}).encode()
    conn = RawConnection(server.port)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        sender = _send_quietly(conn, head + _chunked(body))
        status, headers, raw = conn.response()
        assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
        assert headers.get("connection") == "close"
        sender.join(timeout=10)
    finally:
        conn.close()
    assert_serves(server)


def test_8_a_body_left_half_sent_times_out_and_idle_connections_close(server):
    conn = RawConnection(server.port)
    try:
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        status, headers, raw = conn.response()
        assert status == 408 and json.loads(raw)["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 5 and conn.closed_by_server()
    finally:
        conn.close()
    idle = RawConnection(server.port)
    try:
        idle.request("POST", "/v1/completions", GOOD)
        assert idle.response()[0] == 200
        assert idle.closed_by_server(timeout_s=5)      # --keep-alive-s 1: not held forever
    finally:
        idle.close()
    assert_serves(server)
    deadline = time.monotonic() + 5          # the count drops just after the last byte is sent
    while server.app.state.http.num_active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.app.state.http.num_active == 0      # nothing left holding up a drain


def _num_running(url: str) -> float:
    """The engine's running requests, as serve's /metrics reports them."""
    text = httpx.get(url + "/metrics").text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("enc2dec_num_requests_running")))


def test_7_drain_ends_within_the_timeout_cuts_streams_cleanly_and_exits_1(t5_relu):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    drain_s = 3.0
    cmd = [sys.executable, "-m", "enc2dec.cli.main", "serve", t5_relu, "--port", "0", "--dtype", "float32",
           "--drain-timeout", str(drain_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        from test_serve_ops import _wait_for_url

        url = _wait_for_url(lines, proc)
        deadline = time.monotonic() + 90
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        body = {"prompt": "never finishes in time", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        plain = []
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(
            url + "/v1/completions", json={**body, "stream": False}, timeout=60)))
        waiter.start()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = r.iter_lines()
            first = next(e for e in events if e.startswith("data:"))
            # The plain request's thread may not have reached the server yet: the drain must begin
            # with both requests running, or the plain one is refused as new instead of cut.
            while _num_running(url) < 2:
                assert time.monotonic() < deadline and waiter.is_alive(), "".join(lines)
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = [first] + [e for e in events if e.startswith("data:")]
            ended = time.monotonic() - t0
        code = proc.wait(timeout=30)
        exited = time.monotonic() - t0
        waiter.join(timeout=10)
        assert plain[0].status_code == 503 and "--drain-timeout" in plain[0].json()["error"]["message"]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "server_shutdown" and "--drain-timeout" in err["message"]
        assert ended < drain_s
        assert exited < drain_s + 1.0, (exited, "".join(lines))     # + process teardown
        assert code == 1 and any("drain did not complete" in ln for ln in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
