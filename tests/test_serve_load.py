"""A bounded load test on loopback, and `enc2dec bench --url` against the real server.

200 requests from 32 concurrent clients: plain and streamed completions checked token for
token against the engine's Python API, streams the client abandons after the first event,
and malformed bodies. Afterwards nothing is in flight and both KV pools are empty.
"""
from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest
from enc2dec.cli.main import app as cli_app
from enc2dec.engine import SamplingParams
from test_serve_helpers import LiveServer, ServeConfig, httpx, tiny_llm_factory

NAME = "tiny-t5"
NUM_REQUESTS, CONCURRENCY = 200, 32
PROMPTS = ["translate the house is big", "summarize a short story", "one two three four",
           "the cat sat on the mat", "hello world", "question: why is the sky blue?", "a", "b c d e f g"]
MALFORMED = [
    {"model": NAME, "prompt": "x", "max_tokens": -3},
    {"model": "wrong-model", "prompt": "x"},
    {"model": NAME, "prompt": {"not": "a prompt"}},
    {"model": NAME, "prompt": "x", "n": "two"},
    {"model": NAME},
    b"{\"model\": ",
]


@pytest.fixture(scope="module")
def server(t5_relu):
    srv = LiveServer(ServeConfig(model=t5_relu, served_model_names=(NAME,)),
                     tiny_llm_factory(t5_relu, max_batch_size=16)).start()
    yield srv
    srv.stop()


def _sum(metrics: dict, prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


async def _one(client: httpx.AsyncClient, i: int, expected: dict[str, str]) -> tuple[str, bool, str]:
    """(kind, ok, detail) for request i; the mix is fixed by i."""
    kind = {8: "cancel", 9: "malformed"}.get(i % 10, "stream" if i % 10 in (6, 7) else "plain")
    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == "malformed":
        bad = MALFORMED[i // 10 % len(MALFORMED)]
        r = await (client.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
                   if isinstance(bad, bytes) else client.post("/v1/completions", json=bad))
        ok = 400 <= r.status_code < 500 and "message" in r.json().get("error", {})
        return kind, ok, f"{r.status_code} {r.text[:120]}"
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if kind == "plain":
        r = await client.post("/v1/completions", json=body)
        data = r.json()
        ok = (r.status_code == 200 and data["choices"][0]["text"] == expected[prompt]
              and data["usage"]["completion_tokens"] == 8)
        return kind, ok, r.text[:200]
    if kind == "cancel":
        body.update(max_tokens=200)             # long enough to be running when the client leaves
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return kind, False, f"{r.status_code} {(await r.aread())[:200]!r}"
        text, done = "", False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            text += "".join(c["text"] for c in event["choices"])
            if kind == "cancel":
                return kind, True, "left after the first event"     # closing the stream disconnects
    return kind, done and text == expected[prompt], text


def test_load_mixed_valid_cancelled_and_malformed(server):
    expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, server.llm.generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False))}
    before = server.metrics()

    async def run():
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            sem = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i):
                async with sem:
                    return await _one(client, i, expected)

            return await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS))), 100)

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert len(results) == NUM_REQUESTS
    failures = [(i, r) for i, r in enumerate(results) if not r[1]]
    assert not failures, failures[:5]
    counts = {k: sum(1 for r in results if r[0] == k) for k in ("plain", "stream", "cancel", "malformed")}
    assert counts == {"plain": 120, "stream": 40, "cancel": 20, "malformed": 20}

    after = server.wait_idle()
    for pool in ("self", "cross"):
        assert after[f'enc2dec_kv_blocks_used{{pool="{pool}"}}'] == 0, after
        assert after[f'enc2dec_kv_blocks_free{{pool="{pool}"}}'] == after[f'enc2dec_kv_blocks_total{{pool="{pool}"}}']
    assert after["enc2dec_num_requests_in_flight"] == 0 and after["enc2dec_num_requests_running"] == 0

    def delta(prefix):
        return _sum(after, prefix) - _sum(before, prefix)

    # None lost: the server answered every request, each with the status the client saw.
    assert delta('enc2dec_http_requests_total{endpoint="/v1/completions"') == NUM_REQUESTS
    assert delta('enc2dec_http_requests_total{endpoint="/v1/completions",status="200"}') == 160
    assert delta('enc2dec_http_requests_total{endpoint="/v1/completions",status="499"}') == 20
    assert delta('enc2dec_http_requests_total{endpoint="/v1/completions",status="40') == 20     # 400 and 404
    assert delta('enc2dec_request_finished_total{reason="cancelled"}') == 20
    assert delta("enc2dec_e2e_request_latency_seconds_count") == 160
    print(f"\n{NUM_REQUESTS} requests, {CONCURRENCY} clients: {elapsed:.1f} s")


def test_bench_url_against_the_server(server, tmp_path):
    from typer.testing import CliRunner

    data = tmp_path / "ids.jsonl"
    ids = server.llm.tokenizer.encode("bench this prompt please")
    data.write_text("".join(json.dumps({"input_ids": ids[:4 + k], "output_tokens": 5}) + "\n" for k in range(3)))
    report = tmp_path / "r.json"
    r = CliRunner().invoke(cli_app, ["bench", "--quiet", "--url", server.url, "--dataset", str(data),
                                     "--concurrency", "1,4", "--num-requests", "4", "--warmup", "1",
                                     "--report-json", str(report)])
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert rep["model"] == NAME
    for lv in rep["levels"]:
        assert lv["backend"] == "http" and lv["completed"] == 4 and lv["failed"] == 0
        assert lv["output_tokens"] == 4 * 5           # usage.completion_tokens, exact with ignore_eos
        assert 4 * 4 <= lv["input_tokens"] <= 4 * 6     # usage.prompt_tokens of the rows sent
        assert lv["p50_ttft_ms"] <= lv["p99_e2e_ms"] and lv["out_tok_per_s"] > 0


def test_a_ready_server_keeps_what_it_started_with_out_of_full_collections(t5_relu):
    # The app, the front and the tokenizer live as long as the server: a full collection that
    # scanned them (with torch, transformers and FastAPI) stalled every stream for ~100 ms.
    srv = LiveServer(ServeConfig(model=t5_relu, served_model_names=(NAME,)), tiny_llm_factory(t5_relu)).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "hello world", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200
        long_lived = (srv.app, srv.front, srv.llm.tokenizer)
        tracked = gc.get_objects()
        assert not any(o is x for o in tracked for x in long_lived)
    finally:
        srv.stop()
    # Stopped, they are the collector's again (a process that starts another server frees them).
    tracked = gc.get_objects()
    assert any(o is srv.app for o in tracked)
