"""A server one bad client cannot break, part 1: request validation, errors and the queue
bound, each fed the exact request that once broke it, on a real loopback server (tiny T5).
Every test checks that neighbours are unaffected and the next request is answered."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from test_serve_helpers import LiveServer, RawConnection, ServeConfig, httpx, tiny_llm_factory

from enc2dec.engine import SamplingParams

NAME = "tiny-t5"
GOOD = {"model": NAME, "prompt": "a fine request", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(t5_relu):
    cfg = ServeConfig(model=t5_relu, served_model_names=(NAME,), max_upload_bytes=8 << 20,
                      allowed_origins=("https://app.example",))
    srv = LiveServer(cfg, tiny_llm_factory(t5_relu)).start()
    yield srv
    srv.stop()


def post(server, body, **kw):
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60, **kw)


def assert_serves(server):
    r = post(server, GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


async def _stream(client, url, body) -> tuple[str, list[str]]:
    async with client.stream("POST", url, json=body) as r:
        lines = [ln async for ln in r.aiter_lines() if ln]
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), lines


def test_1_a_poisoned_request_fails_alone_and_its_batch_finishes(server):
    prompts = [f"neighbour number {i}" for i in range(10)]
    ref = [o.outputs[0].text for o in server.llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)]
    poisons = [({"prompt": [5, 6, 1], "max_tokens": 8, "min_tokens": 4, "stop_token_ids": [99999999]},
                "stop_token_ids"),
               ({"prompt": [5, 6, 1], "temperature": 1, "top_k": 100000000000000000000}, "top_k"),
               ({"prompt": [5, 6, 99999999]}, "prompt")]

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            url = server.url + "/v1/completions"
            streams = [asyncio.ensure_future(_stream(client, url, {"model": NAME, "prompt": p, "max_tokens": 16,
                                                                   "temperature": 0, "ignore_eos": True,
                                                                   "stream": True})) for p in prompts]
            await asyncio.sleep(0.05)            # the streams are running when the poison arrives
            bad = await asyncio.gather(*(client.post(url, json=b) for b, _ in poisons))
            return await asyncio.gather(*streams), bad

    streams, bad = asyncio.run(run())
    for r, (_, param) in zip(bad, poisons):
        err = error(r, 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "outside the vocabulary" in bad[0].json()["error"]["message"]
    for (text, lines), want in zip(streams, ref):
        assert lines[-1] == "data: [DONE]" and '"completion_tokens":16' in lines[-2]
        assert text == want
    assert_serves(server)
    assert httpx.get(server.url + "/health").status_code == 200


def test_2_health_and_streams_stay_responsive_during_a_multi_megabyte_prompt(server):
    bodies = [json.dumps({"model": NAME, "prompt": "hello world " * 500_000}).encode(),      # 6 MB, too long
              json.dumps({"model": NAME, "prompt": "x" + " " * 4_000_000, "max_tokens": 2}).encode()]  # 1 token
    answers = []

    def big():
        for b in bodies:
            answers.append(httpx.post(server.url + "/v1/completions", content=b, timeout=120,
                                      headers={"content-type": "application/json"}))

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)
    thread.join()
    err = error(answers[0], 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert answers[1].status_code == 200, answers[1].text
    assert len(latencies) >= 3 and max(latencies) < 0.5, latencies
    assert_serves(server)


def test_5_bad_text_and_internal_errors_keep_the_connection(server, monkeypatch, caplog):
    conn = RawConnection(server.port)
    try:
        for raw, param in ((rb'{"prompt":[5,6,1],"model":"\ud800"}', "model"), (rb'{"prompt":"abc\udbff"}', "prompt")):
            conn.request("POST", "/v1/completions", raw)
            status, _, body = conn.response()
            assert status == 400 and json.loads(body)["error"]["param"] == param, body
            assert b"surrogate" in body
        conn.request("POST", "/v1/completions", json.dumps(GOOD).encode())
        assert conn.response()[0] == 200               # the same keep-alive connection

        import enc2dec.serve.completions as completions

        def broken(outs):
            raise KeyError("secret internals")

        monkeypatch.setattr(completions, "_usage", broken)
        with caplog.at_level(logging.ERROR, logger="enc2dec.serve"):
            conn.request("POST", "/v1/completions", json.dumps(GOOD).encode())
            status, headers, body = conn.response()
        err = json.loads(body)["error"]
        assert status == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
        assert b"secret" not in body and b"KeyError" not in body
        assert err["request_id"] == headers["x-request-id"]
        logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
        assert err["request_id"] in logged and "secret internals" in logged
        monkeypatch.undo()
        conn.request("POST", "/v1/completions", json.dumps(GOOD).encode())
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    finally:
        conn.close()


def test_6_requests_larger_than_the_queue_are_400_and_sequences_are_counted(server):
    err = error(post(server, {"model": NAME, "prompt": [f"p{i}" for i in range(300)], "max_tokens": 2}), 400)
    assert err["code"] == "too_many_sequences" and "300 decoder sequences" in err["message"]
    err = error(post(server, {"model": NAME, "prompt": [f"p{i}" for i in range(5)], "n": 64, "temperature": 1}),
                400)
    assert err["code"] == "too_many_sequences" and "320 decoder sequences" in err["message"]
    assert server.front.num_seqs_in_flight == 0
    assert_serves(server)


@pytest.mark.parametrize("raw,param,code,needle", [
    (json.dumps({"model": NAME, "prompt": "word " * 100}), "prompt", "context_length_exceeded", "max_input_len"),
    (json.dumps({"model": NAME, "prompt": list(range(3, 73))}), "prompt", "context_length_exceeded", "70 tokens"),
    ("", None, None, "the request body is empty"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens", None, "valid integer"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature", None, "finite"),
    ('{"prompt": "x", "temperature": NaN}', "temperature", None, "finite"),
    ('{"prompt": "x", "temperature": true}', "temperature", None, "not a boolean"),
    ('{"prompt": "x", "stream": 1}', "stream", None, "valid boolean"),
    ('{"prompt": "x", "n": 65}', "n", None, "less than or equal"),
    ('{"prompt": "x", "max_tokens": 100000}', "max_tokens", None, "max_num_tokens"),     # the engine's refusal
])
def test_9_fields_are_validated_with_the_param_named(server, raw, param, code, needle):
    r = httpx.post(server.url + "/v1/completions", content=raw.encode(), timeout=30,
                   headers={"content-type": "application/json"})
    err = error(r, 400)
    assert needle in err["message"] and err["param"] == param and err["code"] == code
    assert_serves(server)


def test_9_a_body_without_json_content_type_gets_a_hint(server):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(GOOD).encode(), timeout=30,
                   headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in error(r, 400)["message"]
    assert_serves(server)


def test_9_models_show_served_names_and_cors_is_opt_in(server, t5_relu):
    r = httpx.get(server.url + "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [NAME] and t5_relu not in r.text
    assert t5_relu not in httpx.get(server.url + f"/v1/models/{t5_relu}").text
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(server.url + "/v1/completions", headers={**pre, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = post(server, GOOD, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_9_no_cors_headers_by_default_and_health_503_once_the_engine_thread_dies(t5_relu):
    # In-process: the test replaces the core's step (the engine process's death: test_engine_process.py)
    srv = LiveServer(ServeConfig(model=t5_relu), tiny_llm_factory(t5_relu, engine_process=False)).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Origin": "https://app.example"}, timeout=30)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

        def dead(*a, **k):
            raise SystemError("the engine thread is gone")

        srv.llm.engine.step = dead
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        deadline = time.monotonic() + 10
        while srv.llm.is_healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "failed" and "engine thread died" in r.json()["error"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    finally:
        srv.stop()
