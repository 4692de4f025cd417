"""A running OpenAI-compatible server as a bench target (``--url``), through ``httpx``.

Text requests go to ``/v1/completions`` with ``stream: true`` (so TTFT and ITL are
measured), token ids as the prompt, ``temperature: 0``, ``max_tokens`` plus the
``ignore_eos`` / ``min_tokens`` extensions (vLLM, TensorRT-LLM and enc2dec honour them) so
lengths are exact. Output tokens are the server's ``usage.completion_tokens`` when it
reports them, else the number of streamed chunks. Audio goes to
``/v1/audio/transcriptions`` as a WAV upload; streamed only with ``--streaming``.
"""
from __future__ import annotations

import asyncio
import json
import time

from .audio import wav_bytes
from .errors import BenchInputError
from .metrics import API_PHASE_NAMES, RequestRecord, step_extras
from .workloads import BenchRequest


def _httpx():
    try:
        import httpx
    except ImportError:
        raise BenchInputError("--url needs the 'httpx' package: pip install httpx") from None
    return httpx


# How long --url waits for a server that is still loading its model: a large checkpoint can take
# minutes to load, and a script that started the server has nothing better to do meanwhile.
DEFAULT_READY_TIMEOUT_S = 600.0


def _unavailable_body(r) -> dict:
    """The JSON body of a 503 from /health (enc2dec serve's ``{"status": "loading" | "draining" |
    "failed", "error": ...}``); {} for any other answer."""
    if r.status_code != 503:
        return {}
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchInputError(f"--url {url!r} must start with http:// or https://")
    return url[:-3] if url.endswith("/v1") else url


class HttpTarget:
    name = "http"
    tokenizer = None

    def __init__(self, url: str, model: str | None, concurrency: int, streaming: bool = False,
                 timeout_s: float = 600.0, beam_width: int = 1):
        self.url = normalize_url(url)
        self.model = model
        self.streaming = streaming
        self.beam_width = beam_width
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._steps_before: dict | None = None
        httpx = _httpx()
        self._httpx = httpx
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.AsyncClient(base_url=self.url, limits=limits,
                                        timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def connect(self, ready_timeout_s: float | None = None, progress=None) -> None:
        """Fails fast (exit 2) when nothing answers; waits up to ``ready_timeout_s`` (None:
        ``DEFAULT_READY_TIMEOUT_S``) while the server's /health says 503 ``loading`` (a server
        started just before, as scripts do: enc2dec serve listens at once and loads the model
        behind it); a server whose engine failed is an error at once. Learns the model name
        from /v1/models."""
        if ready_timeout_s is None:
            ready_timeout_s = DEFAULT_READY_TIMEOUT_S
        deadline, waiting = time.monotonic() + ready_timeout_s, False
        try:
            while True:
                health = _unavailable_body(await self.client.get("/health", timeout=10.0))
                status = health.get("status")
                if status == "failed":
                    raise BenchInputError(f"{self.url}: the server's engine failed: "
                                          f"{health.get('error') or 'see its log'}")
                if status != "loading":      # ready, or a server without this /health: go
                    break
                if time.monotonic() >= deadline:
                    raise BenchInputError(f"{self.url} was still loading its model after {ready_timeout_s:g} s "
                                          "(--ready-timeout)")
                if not waiting and progress is not None:      # one step: done once the server is ready
                    progress.start(f"waiting for {self.url} to load its model", 1)
                waiting = True
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            r = await self.client.get("/v1/models", timeout=10.0)
        except self._httpx.HTTPError as e:
            raise BenchInputError(f"cannot reach {self.url}: {type(e).__name__}: {e or 'no answer'}; "
                                  "is the server running?") from None
        if waiting and progress is not None:
            progress.advance()
        if self.model is None and r.status_code == 200:
            try:
                self.model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                pass

    async def begin_level(self) -> None:
        self._steps_before = await self.step_counters()

    async def end_level(self) -> dict:
        return step_extras(self._steps_before, await self.step_counters())

    async def step_counters(self) -> dict | None:
        """The engine's step counters from the server's /metrics (enc2dec serve exports them);
        None from a server without them or without /metrics."""
        try:
            r = await self.client.get("/metrics", timeout=10.0)
        except self._httpx.HTTPError:
            return None
        return parse_step_counters(r.text) if r.status_code == 200 else None

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(start_s=time.monotonic(), input_len=req.input_len, audio_s=req.audio_s)
        try:
            if req.is_audio:
                await self._transcribe(req, rec)
            else:
                await self._complete(req, rec)
        except self._httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.end_s = time.monotonic()
        return rec

    async def _complete(self, req: BenchRequest, rec: RequestRecord) -> None:
        body = {"model": self.model or "", "prompt": req.prompt, "max_tokens": req.output_len,
                "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.beam_width > 1:
            body.update(use_beam_search=True, best_of=self.beam_width, n=1)
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            rec.headers_s = time.monotonic()
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            usage = await self._read_events(resp, rec)
        rec.output_len = int(usage.get("completion_tokens") or len(rec.token_times_s))
        rec.input_len = int(usage.get("prompt_tokens") or rec.input_len)

    async def _transcribe(self, req: BenchRequest, rec: RequestRecord) -> None:
        wave_16k = req.prompt["multi_modal_data"]["audio"][0][0]
        files = {"file": ("audio.wav", wav_bytes(wave_16k), "audio/wav")}
        data = {"model": self.model or "", "response_format": "json", "temperature": "0",
                "max_tokens": str(req.output_len), "ignore_eos": "true",
                "stream": "true" if self.streaming else "false"}
        if self.streaming:
            async with self.client.stream("POST", "/v1/audio/transcriptions", files=files, data=data) as resp:
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    return
                usage = await self._read_events(resp, rec)
        else:
            resp = await self.client.post("/v1/audio/transcriptions", files=files, data=data)
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return
            try:
                usage = resp.json().get("usage") or {}
            except ValueError:
                usage = {}
        rec.output_len = int(usage.get("output_tokens") or usage.get("completion_tokens")
                             or len(rec.token_times_s) or req.output_len)

    @staticmethod
    async def _read_events(resp, rec: RequestRecord) -> dict:
        """Server-sent events: one token arrival per chunk that carries output; returns usage."""
        usage: dict = {}
        done = False
        async for line in resp.aiter_lines():
            # Read on past [DONE] to the body's end (the chunked terminator follows it at once): a
            # response left unread closes its connection, and every request then pays a new one.
            if done or not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if event.get("error"):
                rec.error = f"server error: {event['error']}"
                break
            usage = event.get("usage") or usage
            if event.get("choices") or event.get("type") == "transcript.text.delta":
                rec.token_times_s.append(time.monotonic())
        return usage

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.client.aclose()


# enc2dec serve's names for the engine's step counters (serve/metrics.py STEP_METRICS).
_STEP_COUNTER_NAMES = {"enc2dec_engine_steps_total": "num_steps", "enc2dec_engine_step_rows_total": "num_rows",
                       "enc2dec_engine_step_seconds_total": "step_s",
                       "enc2dec_engine_device_wait_seconds_total": "device_wait_s"}
# Also read when the server exports them (older servers do not).
_REQUEST_COUNTER_NAMES = {"enc2dec_engine_requests_finished_total": "num_finished",
                          "enc2dec_engine_first_token_seconds_total": "first_token_s",
                          "enc2dec_engine_finish_seconds_total": "finish_s",
                          "enc2dec_api_streams_total": "api_streams",
                          "enc2dec_api_loop_ticks_total": "api_loop_ticks",
                          "enc2dec_api_loop_lag_seconds_total": "api_loop_lag_s",
                          **{f"enc2dec_api_{name}_seconds_total": f"api_{name}_s" for name in API_PHASE_NAMES}}


def parse_step_counters(text: str) -> dict | None:
    """The step counters in a Prometheus text exposition (unlabelled samples), or None."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = _STEP_COUNTER_NAMES.get(name) or _REQUEST_COUNTER_NAMES.get(name)
        if key is not None:
            try:
                out[key] = float(value.split()[0])
            except (ValueError, IndexError):
                return None
    return out if all(k in out for k in _STEP_COUNTER_NAMES.values()) else None
