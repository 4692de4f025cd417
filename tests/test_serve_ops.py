"""Operating the server: API key, loading state, queue bound, client disconnects, the
guide's YAML, the `serve` command (missing extra, SIGTERM drain in a real process)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_serve_helpers import LiveServer, ServeConfig, httpx, tiny_llm_factory

openai = pytest.importorskip("openai")
from enc2dec.serve.config import build_llm_args

GUIDE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "trtllm-encoder-decoder-guide.txt"
BODY = {"prompt": "hello there", "max_tokens": 4}


def guide_yaml(tmp_path) -> Path:
    """The guide's enc-dec-config.yaml, cut out of the guide verbatim."""
    if not GUIDE.is_file():
        pytest.skip(f"{GUIDE} is not here")
    text = GUIDE.read_text()
    block = text.split("Save it as enc-dec-config.yaml:", 1)[1].split("Start the server:", 1)[0].strip("\n")
    path = tmp_path / "enc-dec-config.yaml"
    path.write_text(block + "\n")
    return path


def test_api_key_guards_every_endpoint_but_health(t5_relu):
    srv = LiveServer(ServeConfig(model=t5_relu, api_key="sekrit"), tiny_llm_factory(t5_relu)).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                             ("POST", "/v1/completions")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                r = httpx.request(method, srv.url + path, headers=headers, json=BODY)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sekrit"}
        assert httpx.get(srv.url + "/v1/models", headers=good).status_code == 200
        assert httpx.get(srv.url + "/metrics", headers=good).status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model=t5_relu, **BODY).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.stop()


def test_an_api_process_attached_early_answers_loading_until_the_server_opens_its_gate(t5_relu):
    # One of several API processes (serve/server.py): attached, but the first process has not yet
    # seen the others attach. A client's /health 200 must mean every process serves.
    opened = threading.Event()
    srv = LiveServer(ServeConfig(model=t5_relu, retry_after_s=3), tiny_llm_factory(t5_relu))
    srv.front.gate = opened.is_set
    srv.start(wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while srv.front.state != "ready":                          # the engine is up behind the gate
            assert time.monotonic() < deadline
            time.sleep(0.05)
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json() == {"status": "loading"} and h.headers["retry-after"] == "3"
        r = httpx.post(srv.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        opened.set()
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert httpx.post(srv.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    finally:
        srv.stop()


def test_loading_then_ready_then_queue_bound_and_disconnects(t5_relu):
    release = threading.Event()
    make = tiny_llm_factory(t5_relu, max_batch_size=2)

    def slow_llm():
        release.wait(30)
        return make()

    srv = LiveServer(ServeConfig(model=t5_relu, max_queue=2, retry_after_s=3), slow_llm).start(wait_ready=False)
    try:
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json() == {"status": "loading"} and h.headers["retry-after"] == "3"
        r = httpx.post(srv.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "3" and "loading" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        release.set()
        srv.start()                                                  # now waits for 200

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                body = {**BODY, "max_tokens": 48, "ignore_eos": True}
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(16)))

        results = asyncio.run(burst())
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 2, codes
        for r in results:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "3" and "--max-queue" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 48
        m = srv.wait_idle()
        assert m["enc2dec_request_rejected_overload_total"] == codes.count(503)

        # A client that gives up on a plain (non-streamed) request cancels it at once.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**BODY, "max_tokens": 5000, "ignore_eos": True},
                       timeout=httpx.Timeout(10, read=0.5))
        t0 = time.monotonic()
        m = srv.wait_idle(timeout_s=10)
        assert m['enc2dec_kv_blocks_used{pool="self"}'] == 0 and m["enc2dec_num_requests_running"] == 0
        assert time.monotonic() - t0 < 5
        assert m['enc2dec_request_finished_total{reason="cancelled"}'] == 1
        assert m['enc2dec_http_requests_total{endpoint="/v1/completions",status="499"}'] == 1
    finally:
        release.set()
        srv.stop()


def test_guide_yaml_loads_unchanged(tmp_path, t5_relu):
    args = build_llm_args(t5_relu, str(guide_yaml(tmp_path)))
    assert args.attn_backend == "TRTLLM" and args.max_batch_size == 8 and args.encoder_max_batch_size == 2
    assert args.kv_cache_config.cross_kv_cache_fraction == 0.5
    assert args.encoder_cuda_graph_config.seq_lens == (128, 256, 512)
    with pytest.raises(ValueError, match="max_batch_sizes"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("max_batch_sizes: 8\n")
        build_llm_args(t5_relu, str(bad))


def test_a_model_that_cannot_load_stops_the_server_with_exit_2(tmp_path):
    from enc2dec.serve.server import run_server

    missing = str(tmp_path / "no-such-model")
    assert run_server(ServeConfig(model=missing, port=0), build_llm_args(missing)) == 2


def test_serve_without_the_extra_says_what_to_install(monkeypatch):
    import enc2dec.cli.serve as serve_cmd
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    monkeypatch.setattr(serve_cmd, "_importable", lambda m: m != "uvicorn")
    r = CliRunner().invoke(app, ["serve", "some/model"])
    assert r.exit_code == 2 and "pip install 'enc2dec[serve]'" in r.output and "uvicorn" in r.output


def test_help_and_engine_import_work_without_fastapi():
    # pydantic stays: typer itself needs it (and so it is everywhere the CLI runs).
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'multipart', 'prometheus_client'):\n"
               "            raise ModuleNotFoundError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import enc2dec.engine\n"
               "from enc2dec.cli.main import app\n"
               "app(sys.argv[1:])\n")
    env = {**os.environ, "NO_COLOR": "1"}

    def run(*args):
        return subprocess.run([sys.executable, "-c", blocker, *args], capture_output=True, text=True, timeout=60,
                              env=env, check=False)

    r = run("--help")
    assert r.returncode == 0 and "serve" in r.stdout, r.stderr
    r = run("serve", "x")
    assert r.returncode == 2 and "pip install 'enc2dec[serve]'" in r.stderr, (r.stdout, r.stderr)


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path, t5_relu):
    """The real command with the guide's YAML unchanged, the key from the environment."""
    env = {**os.environ, "ENC2DEC_API_KEY": "k3y", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "enc2dec.cli.main", "serve", t5_relu, "--config", str(guide_yaml(tmp_path)),
           "--port", "0", "--served-model-name", "t5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        url = _wait_for_url(lines, proc)
        key = {"Authorization": "Bearer k3y"}
        deadline = time.monotonic() + 90
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        # 500 tokens (about a second here) so that the request is still running after the signal.
        body = {"model": "t5", "prompt": "drain me", "max_tokens": 500, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=key, timeout=60) as r:
            events = r.iter_lines()
            first = next(e for e in events if e.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            assert httpx.get(url + "/health").json()["status"] == "draining"
            refused = httpx.post(url + "/v1/completions", json={"model": "t5", "prompt": "late"}, headers=key)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            rest = [first] + [e for e in events if e.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":500' in rest[-2]
        assert proc.wait(timeout=60) == 0
        assert any("draining" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for_url(lines: list[str], proc, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                return m.group(1)
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    raise TimeoutError("".join(lines))
