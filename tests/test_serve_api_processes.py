"""``enc2dec serve --api-processes N``: N HTTP processes on one port over one engine process.
The real command in a subprocess (loopback, bounded waits): the same answers as the engine
gives in-process, metrics summed over the processes, and a SIGTERM drain that lets a stream in
flight finish before everything exits 0."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_serve_helpers import httpx

from enc2dec.engine import LLM, SamplingParams
from enc2dec.serve.config import build_llm_args

PROMPTS = ["translate the house is big", "a b c d e", "summarize: one two three four", "x y", "hello there"]


# The command as `enc2dec serve` runs it, with --api-processes auto sized as on a GPU host of 8 cores
# (the CPU engine would get 1): the other processes then start only once the engine is up.
AUTO_AS_ON_A_GPU = ("import sys, enc2dec.serve.server as s; s.auto_api_processes = lambda device: 2; "
                    "from enc2dec.cli.main import app; app(sys.argv[1:])")


# As AUTO_AS_ON_A_GPU, and the first process takes 3 s more to see the other one attach (a slow
# host): the window in which one process is ready and the other is not.
SLOW_FIRST = ("import sys, time, enc2dec.serve.server as s; s.auto_api_processes = lambda device: 2; "
              "wait = s._wait_for_workers; s._wait_for_workers = lambda started: (wait(started), time.sleep(3)); "
              "from enc2dec.cli.main import app; app(sys.argv[1:])")


def _start(model: str, *extra: str, auto: bool = False, code: str = AUTO_AS_ON_A_GPU, wait_both: bool = True):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    head = [sys.executable, "-c", code] if auto else [sys.executable, "-m", "enc2dec.cli.main"]
    cmd = [*head, "serve", model, "--device", "cpu", "--dtype", "float32",
           "--port", "0", "--served-model-name", "t5", *(() if auto else ("--api-processes", "2")), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 90
    url = None
    while url is None:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        m = next((re.search(r"listening on (http://\S+)", ln) for ln in list(lines) if "listening on" in ln), None)
        url = m.group(1) if m else None
        time.sleep(0.05)
    # Both processes must be up: each logs "engine ready" once its client is attached.
    while wait_both and sum("engine ready" in ln for ln in list(lines)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.1)
    return proc, url, lines


@pytest.fixture(scope="module")
def server(t5_relu):
    proc, url, lines = _start(t5_relu)
    try:
        yield proc, url, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "t5", "prompt": prompt, "max_tokens": 8, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _completions_answered(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'^enc2dec_http_requests_total\{endpoint="/v1/completions",status="200"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_many_connections_get_the_in_process_engines_answers(server, t5_relu):
    _, url, _ = server
    # The engine options the command builds, in this process.
    with LLM.from_args(build_llm_args(t5_relu, None, dtype="float32", device="cpu")) as local:
        want = [o.outputs[0].text for o in local.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)]
    jobs = [(p, stream) for _ in range(4) for p in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:      # a new connection per request
        got = list(pool.map(lambda job: _complete(url, *job), jobs))
    assert got == [want[PROMPTS.index(p)] for p, _ in jobs]


def test_metrics_count_every_process_whichever_answers_the_scrape(server):
    _, url, _ = server
    before = _completions_answered(url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: _complete(url, p, False), PROMPTS * 2))
    # Scrapes on new connections land on either process; each must give the summed count.
    seen = {_completions_answered(url) for _ in range(6)}
    assert seen == {before + 2 * len(PROMPTS)}


def test_health_200_from_any_process_means_every_process_takes_requests(t5_relu):
    proc, url, lines = _start(t5_relu, auto=True, code=SLOW_FIRST, wait_both=False)
    try:
        deadline = time.monotonic() + 90
        while True:          # a client polling /health, each probe on a new connection
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        body = {"model": "t5", "prompt": "hello there", "max_tokens": 4}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:     # new connections land on either process
            codes = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60).status_code,
                                  range(16)))
        assert codes == [200] * 16, codes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("auto", [False, True], ids=["two", "auto"])
def test_sigterm_lets_a_stream_in_flight_finish_then_every_process_exits_0(t5_relu, auto):
    proc, url, lines = _start(t5_relu, auto=auto)
    try:
        body = {"model": "t5", "prompt": "drain me", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = r.iter_lines()
            first = next(e for e in events if e.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [first] + [e for e in events if e.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":400' in rest[-2]
        assert proc.wait(timeout=60) == 0, "".join(lines)
        assert sum("SIGTERM: draining" in ln for ln in lines) == 2      # both processes drained
        assert not any("Traceback" in ln for ln in lines), "".join(lines)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_api_processes_need_the_engine_process():
    from typer.testing import CliRunner

    from enc2dec.cli.main import app

    r = CliRunner().invoke(app, ["serve", "google/flan-t5-small", "--load-format", "dummy", "--api-processes", "2",
                                 "--no-engine-process"])
    assert r.exit_code == 2 and "engine in its own process" in r.output
    r = CliRunner().invoke(app, ["serve", "google/flan-t5-small", "--api-processes", "0"])
    assert r.exit_code == 2 and "--api-processes must be an integer >= 1" in r.output


def test_auto_api_processes_follow_the_engines_device_and_the_cores(monkeypatch):
    import torch

    from enc2dec.serve import server

    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert server.auto_api_processes(torch.device("cuda", 0)) == 4      # a GPU host of 16 cores
    assert server.auto_api_processes(torch.device("cpu")) == 1          # the CPU engine needs its cores
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert server.auto_api_processes(torch.device("cuda", 0)) == 1
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert server.auto_api_processes(torch.device("cuda", 0)) == 4


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
def test_killing_the_first_process_outright_leaves_no_process_behind(t5_relu):
    proc, url, lines = _start(t5_relu)
    kids = _children(proc.pid)
    assert len(kids) >= 2, kids           # the engine process and the second API process (and a tracker)
    proc.kill()                           # SIGKILL: no drain, no chance to stop the others
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while [k for k in kids if os.path.exists(f"/proc/{k}") and not _is_zombie(k)]:
        assert time.monotonic() < deadline, [open(f"/proc/{k}/cmdline").read() for k in kids
                                             if os.path.exists(f"/proc/{k}")]
        time.sleep(0.2)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

