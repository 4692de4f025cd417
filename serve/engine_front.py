"""The server's only door to the engine: load it, admit requests, await or stream them, abort.

The engine is ``enc2dec.engine.LLM``: its own thread runs the step loop, and
``generate_async`` returns a handle that is awaitable and async-iterable. This front adds
what a server needs on top: a loading / ready / draining / failed state, a bound on the
queue (503 beyond it), abort when the consumer goes away (so KV blocks are freed at once),
and a metrics record for every finished request. Engine internals are read in one place,
``model_info`` and ``engine_stats``, for the scheduler counters the LLM API does not expose.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .config import ServeConfig
from .errors import APIError, bad_request, unavailable

logger = logging.getLogger("enc2dec.serve")
# Input threads per API process. Behind an engine process each one mostly waits for its add's
# reply (an IPC round trip through a busy engine process), so a wave of requests at one API
# process (16 of a 64-stream closed loop) queued behind four of them for their first token.
INPUT_WORKERS = 16
# Request fields the engine's refusals name, most specific first: the 400's ``param``.
_ENGINE_PARAMS = ("stop_token_ids", "top_k", "temperature", "max_tokens", "min_tokens", "logprobs", "best_of")


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    is_whisper: bool
    max_input_len: int | None             # encoder tokens (text models)
    max_decoder_positions: int | None     # Whisper's decoder position table
    vocab_size: int | None = None


def model_info(llm) -> ModelInfo:
    cfg, proc = llm.engine.hf_config, getattr(llm.engine, "processor", None)
    is_whisper = cfg.model_type == "whisper"
    return ModelInfo(cfg.model_type, is_whisper, getattr(proc, "max_input_len", None),
                     getattr(cfg, "max_target_positions", None) if is_whisper else None,
                     getattr(proc, "vocab_size", None) or getattr(cfg, "vocab_size", None))


def engine_stats(llm) -> dict[str, int]:
    """Queue depth, running requests, KV blocks per pool and the step loop's counters
    (``steps``), read without locks (plain lengths).
    A data-parallel engine adds ``replicas``: the same counters per replica, with its index,
    health and the requests routed to it."""
    snapshot = llm.stats()
    # An engine process reports its sequences in the snapshot; in-process they are read off the scheduler.
    running_seqs = snapshot.get("running_seqs")
    if running_seqs is None:
        running_seqs = getattr(getattr(llm.engine, "scheduler", None), "num_running_seqs", snapshot["running"])
    stats = _flat_stats(snapshot, running_seqs)
    if snapshot.get("steps"):
        stats["steps"] = snapshot["steps"]
    if "replicas" in snapshot:
        stats["replicas"] = [{**_flat_stats(r, r.get("running_seqs", r["running"])), "replica": r["replica"],
                              "healthy": r["healthy"], "routed": r["routed"]} for r in snapshot["replicas"]]
    return stats


def _flat_stats(snapshot: dict, running_seqs: int) -> dict[str, int]:
    stats = {"waiting": snapshot["waiting"], "running": snapshot["running"], "running_seqs": running_seqs}
    for pool, usage in snapshot["kv"].items():
        stats[f"{pool}_used"], stats[f"{pool}_total"] = usage["used_blocks"], usage["total_blocks"]
        stats[f"{pool}_free"] = usage["total_blocks"] - usage["used_blocks"]
    return stats


class EngineFront:
    def __init__(self, config: ServeConfig, make_llm: Callable[[], Any], metrics=None):
        self.config = config
        self._make_llm = make_llm
        self.metrics = metrics
        self.llm = None
        self.info: ModelInfo | None = None
        self.state = "loading"           # loading -> ready -> draining; or failed
        # Another API process of a server of several: ready only once the first process opens
        # this (every process attached), so a client that got 200 from /health on one
        # connection never meets a 503 "loading" from a process still attaching on the next.
        self.gate: Callable[[], bool] | None = None
        self.error: str | None = None
        self.num_in_flight = 0           # engine requests submitted and not yet consumed to the end
        self.num_seqs_in_flight = 0      # their decoder sequences (n samples or beams each): the queue bound
        self.failed_on_input = False
        self.batches: set[Batch] = set()
        # Tokenising, audio features and the engine process's add round trip run here, off the
        # event loop.
        self.input_pool = ThreadPoolExecutor(max_workers=INPUT_WORKERS, thread_name_prefix="enc2dec-input")

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            llm = await asyncio.to_thread(self._make_llm)
            self.info = model_info(llm)
        except Exception as e:  # noqa: BLE001 - any load failure makes the server unhealthy
            logger.error("the engine failed to start: %s: %s", type(e).__name__, e)
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self.failed_on_input = isinstance(e, ValueError)      # a bad model or option, not a crash
            return
        self.llm = llm
        # Everything alive now (FastAPI, pydantic's validators, the tokenizer, torch and
        # transformers' modules) lives as long as the server. Unfrozen, every full collection
        # scans it: 90-110 ms each on the CI machine type, several a second under a streaming
        # load, and each one stalls every stream of this process. Frozen, collections skip it.
        gc.collect()
        gc.freeze()
        if self.state == "loading":
            self.state = "ready"
        logger.info("engine ready: %s (%s)", self.config.model, self.info.model_type)

    def begin_drain(self) -> None:
        if self.state in ("ready", "loading"):
            self.state = "draining"

    def cut_all(self, message: str) -> int:
        """Ends every request in flight now (drain timeout): streams get an error event and [DONE]."""
        batches = list(self.batches)
        for b in batches:
            b.cut(message)
        return len(batches)

    async def shutdown(self) -> None:
        self.input_pool.shutdown(wait=False, cancel_futures=True)
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)
            gc.unfreeze()             # what the server held can be collected again

    @property
    def status(self) -> str:
        """``state`` as clients see it: "loading" while the gate is closed."""
        if self.state == "ready" and self.gate is not None:
            if not self.gate():
                return "loading"
            self.gate = None                 # open for good
        return self.state

    @property
    def is_ready(self) -> bool:
        if self.state == "ready" and self.llm is not None and not getattr(self.llm, "is_healthy", True):
            error = getattr(self.llm, "error", None)
            self.state, self.error = "failed", f"the engine thread died: {error!r}"
            logger.error("%s", self.error)
        return self.status == "ready" and self.llm is not None

    def stats(self) -> dict[str, int] | None:
        return engine_stats(self.llm) if self.llm is not None else None

    def replica_health(self) -> list[dict] | None:
        """Each replica's status of a data-parallel engine (None for one engine)."""
        report = getattr(self.llm, "replica_health", None)
        return report() if callable(report) else None

    # ---- admission ----------------------------------------------------------------------------
    def check_size(self, num_seqs: int) -> None:
        """400 for a request of more decoder sequences than the queue holds at all."""
        if num_seqs > self.config.max_queue:
            raise bad_request(f"this request needs {num_seqs} decoder sequences (prompts x n x beams); this server "
                              f"queues at most {self.config.max_queue} (--max-queue): split it", "prompt",
                              "too_many_sequences")

    def check_accepting(self, num_seqs: int = 1) -> None:
        """503 while loading, draining or failed, and when the queue is full; 400 for a request of
        more decoder sequences than the queue holds at all (it could never be admitted)."""
        retry = self.config.retry_after_s
        self.check_size(num_seqs)
        if self.state == "draining":
            raise unavailable("the server is shutting down and takes no new requests", retry)
        if self.state == "failed":
            raise APIError(503, f"the engine failed: {self.error}", code="engine_failed")
        if not self.is_ready:
            raise unavailable("the model is still loading; retry shortly", retry)
        stats = self.stats()
        # What this process queued, or what the engine says waits (other API processes' requests
        # too, as of its last step), whichever is more.
        waiting = max(0, self.num_seqs_in_flight - stats["running_seqs"], stats["waiting"])
        if waiting + num_seqs > self.config.max_queue:
            if self.metrics is not None:
                self.metrics.rejected_overload.inc()
            raise unavailable(f"the server is overloaded ({waiting} decoder sequences queued, --max-queue "
                              f"{self.config.max_queue}); retry later", retry)

    def run_input(self, fn, *args):
        """``fn(*args)`` in the input pool (tokenising, audio decoding, features): never on the loop."""
        return asyncio.get_running_loop().run_in_executor(self.input_pool, fn, *args)

    async def _submit(self, prompt, params, streaming: bool, check=None):
        """``generate_async`` in the input pool (it tokenises or computes audio features), after
        ``check()`` when given (its APIError refuses the request before anything is added).
        A ValueError is the user's mistake (400); a dead engine is a 500."""
        llm = self.llm
        try:
            task = asyncio.ensure_future(self.run_input(_checked_add, check, llm, prompt, params, streaming))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:       # the client left while we prepared the input
                task.add_done_callback(lambda t: t.exception() is None and t.result().abort())
                raise
        except ValueError as e:
            message = str(e)
            if "max_input_len" in message or "position table" in message:
                raise bad_request(message, "prompt", "context_length_exceeded") from None
            param = next((p for p in _ENGINE_PARAMS if p in message), None)
            raise bad_request(message, param) from None
        except RuntimeError as e:                # the LLM was shut down, or its engine thread died
            if "shut down" in str(e):
                raise unavailable("the server is shutting down and takes no new requests",
                                  self.config.retry_after_s) from None
            self.state, self.error = "failed", str(e)
            raise APIError(500, f"engine error: {e}", code="engine_error") from None

    async def submit(self, prompts: list, params, streaming: bool, check=None) -> Batch:
        """Submit every prompt, all or none: a bad one aborts those already in (400 names it).
        ``check()`` (e.g. prompt lengths) runs in the input pool before the first add."""
        seqs_each = params.beam_width if params.use_beam_search else params.n
        self.check_accepting(len(prompts) * seqs_each)
        batch = Batch(self, len(prompts), len(prompts) * seqs_each)
        try:
            if check is not None and len(prompts) > 1:
                await self.run_input(check)     # its errors name their prompt already
                check = None
            for i, prompt in enumerate(prompts):
                try:
                    batch.handles.append(await self._submit(prompt, params, streaming, check))
                except APIError as e:
                    if len(prompts) > 1 and e.status == 400:
                        e.message = f"prompt {i}: {e.message}"
                    raise
        except BaseException:
            batch.close()
            raise
        return batch

    @contextmanager
    def reserve(self, num_requests: int):
        """Count engine requests made by a library call (long-form transcription) as in flight."""
        self.num_in_flight += num_requests
        self.num_seqs_in_flight += num_requests
        try:
            yield
        finally:
            self.num_in_flight -= num_requests
            self.num_seqs_in_flight -= num_requests

    def record_long_form(self, num_windows: int, num_tokens: int, seconds: float, failed: bool) -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(reason="error" if failed else "stop").inc(num_windows)
            self.metrics.generation_tokens.inc(num_tokens)
            self.metrics.e2e.observe(seconds)

    def observe_stream(self, received: float, out, first_out: float, first_sent: float, last_out: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_stream(received, out, first_out, first_sent, last_out)

    def finish(self, out) -> None:
        """Record a final output; raise a 500 when the engine failed the request."""
        if self.metrics is not None:
            self.metrics.observe_output(out)
        if out.error:
            raise APIError(500, out.error if out.error.startswith("engine") else f"engine error: {out.error}",
                           code="engine_error")

    async def generate(self, prompts: list, params) -> list:
        """Final outputs of every prompt, in order; cancelling the caller aborts them."""
        batch = await self.submit(prompts, params, streaming=False)
        try:
            outs = [await h for h in batch.handles]
        finally:
            batch.close()
        if batch.cut_reason:
            raise unavailable(batch.cut_reason, self.config.retry_after_s)
        for out in outs:
            self.finish(out)
        return outs


def _checked_add(check, llm, prompt, params, streaming: bool):
    if check is not None:
        check()
    return llm.generate_async(prompt, params, streaming)


class Batch:
    """The engine requests of one HTTP request. ``close()`` (idempotent) aborts the unfinished
    ones, so a client that leaves frees its KV blocks at the engine's next step."""

    def __init__(self, front: EngineFront, num_requests: int, num_seqs: int | None = None):
        self.front = front
        self.handles: list = []
        self._num = num_requests
        self._num_seqs = num_requests if num_seqs is None else num_seqs
        self._closed = False
        self.cut_reason: str | None = None
        self._queue: asyncio.Queue | None = None
        front.num_in_flight += num_requests
        front.num_seqs_in_flight += self._num_seqs
        front.batches.add(self)

    def cut(self, reason: str) -> None:
        """End this batch now: abort its requests; a stream in progress ends with ``reason``."""
        if self._closed:
            return
        self.cut_reason = reason
        if self._queue is not None:
            self._queue.put_nowait((-1, None))
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.front.num_in_flight -= self._num
        self.front.num_seqs_in_flight -= self._num_seqs
        self.front.batches.discard(self)
        metrics = self.front.metrics
        for h in self.handles:
            if not h.done():
                h.abort()
                if metrics is not None:
                    metrics.finished.labels(reason="cancelled").inc()

    async def stream(self) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, cumulative RequestOutput) as they arrive, all prompts interleaved.
        Outputs that queued up while the consumer was busy are coalesced to each prompt's
        newest (they are cumulative, so nothing is lost): under load one event carries the
        tokens of several engine steps. Ends early when the batch is closed; ``cut_reason``
        then says whether it was cut."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue

        async def pump(i, handle):
            try:
                async for out in handle:
                    queue.put_nowait((i, out))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            remaining = len(tasks)
            while remaining and not self._closed:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                newest: dict[int, Any] = {}
                cut = False
                for i, out in items:
                    if i < 0:
                        cut = True
                    elif out is None:
                        remaining -= 1
                    else:
                        newest[i] = out
                for i, out in newest.items():
                    yield i, out
                if cut:
                    break
        finally:
            for t in tasks:
                t.cancel()
            self.close()
