"""The API side of ``enc2dec serve`` alone: how many streamed tokens per second it can carry,
and what each costs in CPU time, with an engine that costs nothing.

A lab script (bench/scripts is not installed), CPU only. The server is the real one (the
FastAPI app, uvicorn, ``ProcessLLM``'s parent side: reader thread, delta rebuild, handles,
SSE); only its engine child is replaced by one that speaks the same wire and emits one
token per live request every ``--step-ms`` (what the engine does on the GPU: about 1.8 ms
per step at C=64 on flan-t5-large). Clients: ``enc2dec bench --url`` (the real one) and a
raw socket reader that only counts events, so a client-side limit shows as the difference.

    python bench/scripts/serve_overhead.py --concurrency 64 --output-len 128 --step-ms 1.8

Prints, per client: out tok/s against the synthetic engine's rate and the server process's
CPU microseconds per streamed token (robust on a shared machine, unlike wall rates).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

# ---- the synthetic engine child ------------------------------------------------------------------


def synthetic_child(args, conn, step_s: float) -> None:
    """``engine_process._child_main``'s wire with no model: "ready" with a real snapshot (from
    the tiny checkpoint), then one "out" message per step with one token for every request."""
    import dataclasses
    import signal

    from enc2dec.engine import engine_process as ep
    from enc2dec.engine.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sender = ep._ChildSender(conn)
    llm = LLM.from_args(dataclasses.replace(args, engine_process=False))
    stats = ep._stats(llm)
    sender.send(("ready", ep._snapshot(llm)))
    llm.shutdown()
    live: dict[str, list] = {}        # rid -> [max_tokens, emitted, arrival, token times sent]
    lock = threading.Lock()
    stop = threading.Event()

    def steps():
        next_t = time.monotonic()
        while not stop.is_set():
            next_t += step_s
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now = time.monotonic()
            deltas = []
            with lock:
                for rid, st in list(live.items()):
                    st[1] += 1
                    finished = st[1] >= st[0]
                    head = ("", [0] * 8) if st[1] == 1 else None
                    # EngineCore._delta's completion: index, new ids, text, text_replaces, finish and
                    # stop reason, cumulative logprob, new logprobs, prefix logprobs
                    comps = [(0, [5], " x", False, "length" if finished else None, None, None, None, None)]
                    deltas.append((rid, head, comps, finished, None,
                                   (st[2], st[2], now if st[1] == 1 else None, now if finished else None, 0, [now])))
                    if finished:
                        del live[rid]
                n = len(live)
            if deltas:
                sender.send(("out", deltas, {**stats, "running": n, "running_seqs": n, "waiting": 0}))

    threading.Thread(target=steps, daemon=True).start()
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if msg[0] == "add":
                batch = pickle.loads(msg[2])
                with lock:
                    for rid, _inputs, _text, params, _streaming in batch:
                        live[rid] = [params.max_tokens or 16, 0, time.monotonic()]
                sender.send(("reply", msg[1], True, None))
            elif msg[0] == "abort":
                with lock:
                    live.pop(msg[1], None)
            elif msg[0] == "call":
                sender.send(("reply", msg[1], False, RuntimeError("the synthetic engine takes no calls")))
            elif msg[0] == "shutdown":
                return
    finally:
        stop.set()
        try:
            sender.send(("closed",))
        except OSError:
            pass


def _child_entry(args, conn, env=None, num_threads=None, step_s=None):
    synthetic_child(args, conn, float(os.environ["SYNTH_STEP_S"]) if step_s is None else step_s)


def run_server(model: str, port: int, step_s: float) -> None:
    from enc2dec.engine.config import LlmArgs
    from enc2dec.engine.engine_process import ProcessLLM
    from enc2dec.serve.app import build_app
    from enc2dec.serve.config import ServeConfig
    from enc2dec.serve.server import bind_socket, make_server

    os.environ["SYNTH_STEP_S"] = str(step_s)      # the spawned child reads it

    class SyntheticLLM(ProcessLLM):
        child_main = staticmethod(_child_entry)

    args = LlmArgs(model=model, device="cpu", load_format="dummy", max_batch_size=1024, engine_process=True,
                   kv_cache_config={"cross_kv_cache_fraction": 0.5})
    config = ServeConfig(model=model, port=port, max_queue=4096, log_level="warning")
    app = build_app(config, make_llm=lambda: SyntheticLLM(args))
    sock = bind_socket("127.0.0.1", port)
    make_server(app, config).run(sockets=[sock])


# ---- clients ------------------------------------------------------------------------------------


async def _raw_stream(port: int, body: bytes, counts: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    n = 0
    while True:
        line = await reader.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {") and b'"choices":[{' in line:
            n += len(json.loads(line[6:])["choices"][0]["text"]) // 2     # the synthetic token is " x"
    writer.close()
    counts.append(n)


async def raw_client(port: int, model: str, concurrency: int, num_requests: int, output_len: int) -> tuple[int, float]:
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": output_len, "stream": True}).encode()
    counts: list = []
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            await _raw_stream(port, body, counts)

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(num_requests)))
    return sum(counts), time.monotonic() - t0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the engine child is excluded
    below by measuring it alone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def _own_cpu_s(client: str) -> float:
    """CPU seconds of the client: this process for the raw one, the finished subprocess for bench."""
    import resource

    who = resource.RUSAGE_SELF if client == "raw" else resource.RUSAGE_CHILDREN
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=1.8)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--clients", default="raw,bench")
    ap.add_argument("--server-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.server_only:
        run_server(a.model, a.port, a.step_ms / 1000)
        return 0

    folder = "google/flan-t5-small"    # dummy weights: only its snapshot (tokenizer, vocab) is used
    server = subprocess.Popen([sys.executable, __file__, "--server-only", "--model", folder,
                               "--port", str(a.port), "--step-ms", str(a.step_ms)])
    import httpx

    try:
        for _ in range(600):
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode})")
            try:
                if httpx.get(f"http://127.0.0.1:{a.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        engine_rate = a.concurrency / (a.step_ms / 1000)
        rows = []
        for client in a.clients.split(","):
            cpu0, client0 = _cpu_s(server.pid), _own_cpu_s(client)
            if client == "raw":
                tokens, wall = asyncio.run(raw_client(a.port, folder, a.concurrency, a.num_requests, a.output_len))
            else:
                report = os.path.join(tempfile.mkdtemp(), "r.json")
                subprocess.run(["enc2dec", "bench", "--url", f"http://127.0.0.1:{a.port}", "--model", folder,
                                "--concurrency", str(a.concurrency), "--num-requests", str(a.num_requests),
                                "--warmup", "0", "--input-len", "8", "--output-len", str(a.output_len),
                                "--streaming", "--report-json", report], check=True, stdout=subprocess.DEVNULL)
                with open(report) as f:
                    lvl = json.load(f)["levels"][0]
                tokens, wall = lvl["output_tokens"], lvl["duration_s"]
            cpu, client_cpu = _cpu_s(server.pid) - cpu0, _own_cpu_s(client) - client0
            rows.append((client, tokens / wall, cpu / tokens * 1e6, client_cpu / tokens * 1e6))
        print(f"\nsynthetic engine: C={a.concurrency}, one token per request every {a.step_ms} ms "
              f"= {engine_rate:,.0f} tok/s at most")
        print(f"{'client':8} {'out tok/s':>10} {'of engine':>9} {'server CPU us/token':>20} {'client CPU us/token':>20}")
        for client, rate, us, cus in rows:
            print(f"{client:8} {rate:>10,.0f} {rate / engine_rate:>9.2f} {us:>20.1f} {cus:>20.1f}")
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
