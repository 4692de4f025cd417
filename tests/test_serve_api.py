"""`enc2dec serve` as a client sees it: the official openai client and httpx against a real
uvicorn server on 127.0.0.1 serving the tiny T5 (relu) checkpoint."""
from __future__ import annotations

import json

import pytest
from test_serve_helpers import LiveServer, ServeConfig, fail_next_steps, httpx, tiny_llm_factory

openai = pytest.importorskip("openai")
from enc2dec.engine import SamplingParams

NAME = "tiny-t5"


@pytest.fixture(scope="module")
def server(t5_relu):
    cfg = ServeConfig(model=t5_relu, served_model_names=(NAME, "alias"), max_upload_bytes=64 << 10,
                      max_prompt_tokens=48)
    srv = LiveServer(cfg, tiny_llm_factory(t5_relu)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(server, prompt, **kw) -> list:
    """The same engine through its Python API."""
    return server.llm.generate(prompt, SamplingParams(**kw)).outputs


def test_plain_completion_matches_the_engine_and_reports_usage(server, client):
    r = client.completions.create(model=NAME, prompt="translate the house is big", max_tokens=12, temperature=0)
    ref = reference(server, "translate the house is big", max_tokens=12, temperature=0)[0]
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    prompt_len = len(server.llm.tokenizer.encode("translate the house is big"))
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == prompt_len + len(ref.token_ids)


def test_streaming_concatenates_to_the_plain_text_and_ends_with_usage(server, client):
    kw = dict(model=NAME, prompt="stream me some words", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10
    with_usage = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in with_usage[:-1])


def test_raw_stream_is_sse_ending_with_done(server):
    body = {"model": NAME, "prompt": "raw events", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4


def test_n_samples_and_prompt_lists_number_choices_like_openai(server, client):
    r = client.completions.create(model=NAME, prompt="sample three", max_tokens=8, temperature=1.0, seed=3, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model=NAME, prompt="sample three", max_tokens=8, temperature=1.0, seed=3,
                                      n=3, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]      # seeded
    chunks = list(client.completions.create(model=NAME, prompt="sample three", max_tokens=8, temperature=1.0,
                                            seed=3, n=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == [c.text for c in r.choices]
    both = client.completions.create(model="alias", prompt=["first prompt", "second one"], max_tokens=5,
                                     temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[2].text == reference(server, "second one", max_tokens=5, temperature=0)[0].text


def test_token_id_prompts_logprobs_and_stop(server, client):
    ids = server.llm.tokenizer.encode("token ids in")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    ref = reference(server, ids, max_tokens=6, temperature=0, logprobs=2)[0]
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(ref.logprobs[0][ref.token_ids[0]], abs=1e-5)
    two = client.completions.create(model=NAME, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(ids) + 3
    free = reference(server, "stop here please", max_tokens=12, temperature=0, ignore_eos=True)[0].text
    stop = free.strip()[2:4] if len(free.strip()) >= 4 else None
    if stop:
        s = client.completions.create(model=NAME, prompt="stop here please", max_tokens=12, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
        assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop"


def test_models_health_version_and_metrics(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, "alias"] and client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json()["version"]
    m = server.wait_idle()
    for key in ('enc2dec_kv_blocks_total{pool="self"}', 'enc2dec_kv_blocks_free{pool="cross"}',
                "enc2dec_num_requests_waiting", "enc2dec_num_requests_running",
                "enc2dec_time_to_first_token_seconds_count", "enc2dec_e2e_request_latency_seconds_count",
                "enc2dec_generation_tokens_total", "enc2dec_prompt_tokens_total"):
        assert key in m, key
    assert m['enc2dec_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m["enc2dec_e2e_request_latency_seconds_count"] >= 1 and m["enc2dec_generation_tokens_total"] > 0
    # The engine's step counters: each generated token took a decoder row of some step.
    assert m["enc2dec_engine_steps_total"] > 0 and m["enc2dec_engine_encodes_total"] >= 1
    assert m["enc2dec_engine_step_rows_total"] >= m["enc2dec_generation_tokens_total"]
    assert 0 <= m["enc2dec_engine_device_wait_seconds_total"] <= m["enc2dec_engine_step_seconds_total"]
    assert m["enc2dec_engine_requests_finished_total"] >= 1
    assert 0 < m["enc2dec_engine_first_token_seconds_total"] <= m["enc2dec_engine_finish_seconds_total"]


def test_bench_url_reports_the_servers_engine_steps(server, tmp_path):
    """bench --url reads the engine's step counters from /metrics before and after a level, so a
    serving loss can be told apart: slower or emptier engine steps, or time lost around them."""
    from typer.testing import CliRunner

    from enc2dec.cli.main import app

    data, out = tmp_path / "d.jsonl", tmp_path / "r.json"
    data.write_text("".join(json.dumps({"input_ids": [5 + i, 9, 17, 30 + i], "output_tokens": 6}) + "\n"
                            for i in range(4)))
    r = CliRunner().invoke(app, ["bench", "--quiet", "--url", server.url, "--model", NAME, "--dataset", str(data),
                                 "--concurrency", "2", "--num-requests", "4", "--report-json", str(out)])
    assert r.exit_code == 0, r.output
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["completed"] == 4 and lv["output_tokens"] == 24
    assert lv["engine_steps"] > 0 and 0 < lv["engine_rows_per_step"] <= 2
    assert lv["engine_steps"] * lv["engine_rows_per_step"] >= lv["output_tokens"]
    # The engine's own request times: inside what the client waited, the rest is HTTP and the API side.
    assert 0 < lv["engine_ttft_ms"] <= lv["mean_ttft_ms"]
    assert lv["engine_ttft_ms"] <= lv["engine_e2e_ms"] <= lv["mean_e2e_ms"]
    # Text requests stream: the server's phases of each stream outside the engine (before it, the
    # first token's way out, after the finish) lie inside what the client measured.
    phases = [lv[f"api_{p}_ms"] for p in ("to_engine", "first_hop", "first_send", "finish_hop")]
    assert all(p is not None and p >= 0 for p in phases), phases
    to_engine, first_hop, first_send, finish_hop = phases
    assert to_engine > 0                  # validation and the hop to the engine take some time
    assert to_engine + lv["engine_ttft_ms"] + first_hop + first_send <= lv["mean_ttft_ms"]
    assert to_engine + lv["engine_e2e_ms"] + finish_hop <= lv["mean_e2e_ms"]
    # The response's headers leave after the add: the client sees them after the server's receipt phase.
    assert to_engine <= lv["client_headers_ms"] <= lv["mean_ttft_ms"]
    assert lv["api_loop_lag_ms"] is not None and lv["api_loop_lag_ms"] >= 0


@pytest.mark.parametrize("body, status, param, needle", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"model": NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"model": NAME, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "Unrecognized request argument"),
    ({"model": NAME}, 400, "prompt", "required"),
    ({"model": NAME, "prompt": []}, 400, "prompt", "empty"),
    ({"model": NAME, "prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    ({"model": NAME, "prompt": [1, 2, 999999]}, 400, None, "outside the vocabulary"),
    ({"model": NAME, "prompt": "x", "use_beam_search": True, "best_of": 2}, 400, "best_of", "max_beam_width=1"),
    ({"model": NAME, "prompt": "x", "best_of": 3}, 400, "best_of", "use_beam_search"),
    ({"model": NAME, "prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ({"model": NAME, "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "min_tokens"),
    ({"model": NAME, "prompt": "x", "logprobs": 50}, 400, "logprobs", "less than or equal"),
    ({"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"model": NAME, "prompt": ["ok", "word " * 60]}, 400, "prompt", "prompt 1 has"),
    ({"model": NAME, "prompt": ["ok", [5]]}, 400, "prompt", "a list of token-id lists"),
    ({"model": NAME, "prompt": [1, True]}, 400, "prompt", "a list of token-id lists"),
])
def test_bad_requests_get_openai_errors(server, body, status, param, needle):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert err["param"] == param


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_beam_width"):
        client.completions.create(model=NAME, prompt="x", extra_body={"use_beam_search": True, "best_of": 2})


def test_invalid_json_oversize_body_unknown_route_and_wrong_endpoint(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x" * (70 << 10)}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    def chunked(data: bytes):                 # no Content-Length: the server counts what arrives
        yield from (data[i:i + 4096] for i in range(0, len(data), 4096))

    small = json.dumps({"model": NAME, "prompt": "chunked body", "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=chunked(small), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    big = json.dumps({"model": NAME, "prompt": "y" * (80 << 10)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=chunked(big), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")},
                   data={"model": NAME}, timeout=10)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]


def test_engine_error_is_a_500_and_the_server_keeps_serving(server, client):
    fail_next_steps(server.llm)
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "boom", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected device fault" in err["message"]
    fail_next_steps(server.llm)         # the same fault under a stream: an error event, then [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": NAME, "prompt": "boom", "max_tokens": 4, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert "injected device fault" in json.loads(lines[-2][6:])["error"]["message"]
    ok = client.completions.create(model=NAME, prompt="after the fault", max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.wait_idle()
    assert m['enc2dec_http_requests_total{endpoint="/v1/completions",status="500"}'] == 1
    assert m['enc2dec_request_finished_total{reason="error"}'] == 2


@pytest.fixture(scope="module")
def beam_server(t5_relu):
    srv = LiveServer(ServeConfig(model=t5_relu, served_model_names=(NAME,)),
                     tiny_llm_factory(t5_relu, max_beam_width=4)).start()
    yield srv
    srv.stop()


def test_beam_search_fields_reach_the_engine(beam_server):
    from enc2dec.serve.protocol import CompletionRequest

    fields = {"use_beam_search": True, "best_of": 4, "n": 2, "length_penalty": 0.5, "early_stopping": "never"}
    params = CompletionRequest(prompt="x", max_tokens=8, **fields).sampling_params()
    assert (params.use_beam_search, params.best_of, params.n, params.length_penalty, params.early_stopping) == \
        (True, 4, 2, 0.5, "never")
    prompts = ["translate the house is big", "hello"]
    r = httpx.post(beam_server.url + "/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": 8,
                                                              **fields}, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        ref = reference(beam_server, prompt, max_tokens=8, **fields)
        assert [c["text"] for c in choices[2 * i:2 * i + 2]] == [o.text for o in ref]
    assert r.json()["usage"]["completion_tokens"] == sum(len(o.token_ids) for p in prompts
                                                         for o in reference(beam_server, p, max_tokens=8, **fields))
    streamed = httpx.post(beam_server.url + "/v1/completions", json={"model": NAME, "prompt": prompts[0],
                                                                     "max_tokens": 8, "stream": True, **fields},
                          timeout=60)
    events = [json.loads(line[5:]) for line in streamed.text.splitlines()
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[k] for k in sorted(texts)] == [c["text"] for c in choices[:2]]
    r = httpx.post(beam_server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "use_beam_search": True,
                                                              "best_of": 8}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert "best_of=8" in r.json()["error"]["message"] and "max_beam_width=4" in r.json()["error"]["message"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_token_event_from_the_template_is_the_generic_event_byte_for_byte(include_usage):
    """The streamed token's fast path (serve/completions.py) must be what the generic path sends:
    the same keys in the same order, and text escaped the same (quotes, controls, non-ASCII)."""
    from enc2dec.serve.completions import token_event_renderer
    from enc2dec.serve.streaming import sse

    render = token_event_renderer('cmpl-"x"', 1733500000, "org/model ü", include_usage)
    for text in ["", "a", 'say "hi"', "back\\slash", "line\nbreak", "ünï 日本", "\u2028", "\x00\x1f", "😀"]:
        event = {"id": 'cmpl-"x"', "object": "text_completion", "created": 1733500000, "model": "org/model ü",
                 "choices": [{"index": 5, "text": text, "finish_reason": None, "logprobs": None}]}
        if include_usage:
            event["usage"] = None
        assert render(5, text) == sse(event)
