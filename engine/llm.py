"""The public LLM API (TensorRT-LLM's names): ``generate``, ``generate_async``, ``shutdown``.

One background thread owns the engine and runs its step loop; callers talk to it through
a command queue and get ``RequestHandle`` objects back (future-like, awaitable, and
iterable when streaming).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from typing import Any, Iterable

from enc2dec.engine.config import LlmArgs
from enc2dec.engine.engine_core import EngineCore
from enc2dec.engine.lifecycle import ShutdownOnExit
from enc2dec.engine.outputs import RequestOutput
from enc2dec.engine.runner.cpu_threads import release_thread_pool
from enc2dec.engine.sampling_params import SamplingParams


def _set_all(events) -> None:
    for event in events:
        event.set()


class RequestHandle:
    """A request in flight. ``result()`` blocks, ``await handle`` / ``aresult()`` await, and
    iterating (sync or async) yields each streamed ``RequestOutput`` until the last."""

    def __init__(self, llm: "LLM", request_id: str, streaming: bool):
        self._llm = llm
        self.request_id = request_id
        self.streaming = streaming
        self._updates: list[RequestOutput] = []
        self._final: RequestOutput | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # called from the engine thread
    def _push(self, out: RequestOutput) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]:
        """Record ``out``; returns the async waiters to wake (``LLM._deliver`` wakes each event
        loop once per step, not once per request)."""
        with self._cond:
            self._updates.append(out)
            if out.finished:
                self._final = out
            self._cond.notify_all()
            return list(self._waiters)

    def done(self) -> bool:
        return self._final is not None

    def result(self, timeout: float | None = None) -> RequestOutput:
        if self._final is None:
            self._llm._release_caller_pool()
        with self._cond:
            if not self._cond.wait_for(lambda: self._final is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._final

    async def aresult(self) -> RequestOutput:
        async for _ in self._aiter_updates():
            pass
        return self._final

    def __await__(self):
        return self.aresult().__await__()

    def abort(self) -> None:
        self._llm._abort(self.request_id)

    def __iter__(self):
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._updates) > seen)
                batch = self._updates[seen:]
            seen += len(batch)
            yield from batch
            if batch and batch[-1].finished:
                return

    def __aiter__(self):
        return self._aiter_updates()

    async def _aiter_updates(self):
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        seen = 0
        try:
            while True:
                with self._cond:
                    batch = self._updates[seen:]
                    event.clear()
                seen += len(batch)
                for out in batch:
                    yield out
                if batch and batch[-1].finished:
                    return
                if not batch:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))


class LLM(ShutdownOnExit):
    """Encoder-decoder LLM. ``LLM(model, **options)``; options are ``LlmArgs`` fields.
    ``engine_process=True`` gives a ``ProcessLLM`` (the same surface, the engine in a child process);
    ``data_parallel_size=N > 1`` a ``DataParallelLLM`` (N of those behind one front)."""

    def __new__(cls, model: str = "", tokenizer: Any = None, **kwargs):
        if cls is LLM:
            args = kwargs.get("_args") or LlmArgs.from_dict(kwargs, model=str(model), tokenizer=tokenizer)
            if args.data_parallel_size > 1:
                from enc2dec.engine.data_parallel import DataParallelLLM

                return DataParallelLLM(args)
            if args.engine_process:
                from enc2dec.engine.engine_process import ProcessLLM

                return ProcessLLM(args)
        return super().__new__(cls)

    def __init__(self, model: str, tokenizer: Any = None, **kwargs):
        self.args = kwargs.pop("_args", None) or LlmArgs.from_dict(kwargs, model=str(model), tokenizer=tokenizer)
        self._core = EngineCore(self.args)
        self._cpu = self._core.device.type == "cpu"
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="enc2dec-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: LlmArgs) -> "LLM":
        return cls(args.model, _args=args)

    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def engine(self) -> EngineCore:
        return self._core

    @property
    def model_info(self) -> dict:
        """What was loaded and how it decodes (for servers, reports and evals)."""
        core, proc = self._core, self._core.processor
        return {
            "model": self.args.model, "model_type": core.hf_config.model_type,
            "dtype": str(core.dtype).replace("torch.", ""), "device": str(core.device),
            "attn_backend": core.runner.backend.name, "cuda_graphs": core.runner.graphs is not None,
            "overlap_scheduler": core.overlap, "tensor_parallel_size": self.args.tensor_parallel_size,
            "vocab_size": proc.vocab_size,
            "max_input_len": proc.max_input_len, "eos_token_ids": list(proc.eos_token_ids),
            "decoder_start_token_id": proc.decoder_start_token_id,
            "forced_bos_token_id": proc.forced_bos_token_id,
            "whisper_default_prefix": list(proc.whisper_default_prefix),
        }

    @property
    def is_healthy(self) -> bool:
        """False once shut down or after the engine thread died (see ``error``)."""
        return not self._stop and self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stats(self) -> dict:
        """Queue depth, KV blocks per pool and the step loop's counters (``EngineCore.StepCounters``)
        in one snapshot (safe from any thread: plain reads)."""
        return {**self.queue_stats(), "kv": self.kv_cache_usage(), "steps": self._core.counters.as_dict()}

    def kv_cache_usage(self) -> dict[str, dict[str, int]]:
        """Blocks used / total per pool and tokens per block (a snapshot; for metrics)."""
        return kv_usage(self._core)

    def reset_kv_peaks(self) -> None:
        """Start the pools' ``peak_used_blocks`` again from what they hold now (between two steps)."""
        self.call_on_engine(reset_kv_peaks).result()

    def queue_stats(self) -> dict[str, int]:
        """Waiting and running requests (a snapshot; for metrics)."""
        return {"waiting": self._core.scheduler.num_waiting, "running": self._core.scheduler.num_running}

    # ---- public API -----------------------------------------------------------------------
    def generate(self, inputs, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True):
        single, prompts, params = batch_of(inputs, sampling_params)
        self._release_caller_pool()
        tracked = []
        for i, (p, sp) in enumerate(zip(prompts, params)):     # validate all before running any
            try:
                tracked.append(self._core.make_request(p, sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}" if not single else str(e)) from None
        handles = self._submit_all(tracked)
        results = wait_all(handles, use_tqdm and len(handles) > 1)
        if self._error is not None:      # the engine died under these requests (e.g. a TP worker did)
            raise RuntimeError(str(self._error)) from self._error
        return results[0] if single else results

    def generate_async(self, inputs, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestHandle:
        return self._submit(self._core.make_request(inputs, sampling_params, streaming))

    def call_on_engine(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine_core)`` on the engine thread between two steps and return its result
        as a future: work that needs the loaded model (Whisper's word alignment) runs without
        racing the step loop for it. ``fn`` should be short; decoding waits while it runs."""
        if self._stop:
            raise RuntimeError("the LLM has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine thread died: {self._error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        if not self._thread.is_alive():        # the loop ended between the checks and the put
            self._fail_pending_calls()
        return future

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._core.shutdown()

    # ---- the caller's thread ----------------------------------------------------------------
    def _release_caller_pool(self) -> None:
        """Before the calling thread blocks on the engine: on the CPU, free the OpenMP pool it may
        hold, which would throttle the engine thread's (cpu_threads.py). Not on the way in of
        ``generate_async``: a caller that goes on working meanwhile (a server, a streaming
        client) may need its cores, and a pool it rebuilds each time would cost more."""
        if self._cpu:
            release_thread_pool()

    # ---- engine thread ----------------------------------------------------------------------
    def _submit(self, tracked) -> RequestHandle:
        return self._submit_all([tracked])[0]

    def _submit_all(self, tracked: list) -> list[RequestHandle]:
        """One command for all of them: the engine thread adds a ``generate`` call's requests
        between the same two steps, so they are admitted together whatever the thread timing (one
        at a time, a step could start with part of them, and the batch's shape, hence the last
        bits of a float32 CPU product and a near-tie between beams, would vary run to run)."""
        if self._stop:
            raise RuntimeError("the LLM has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine thread died: {self._error!r}")
        handles = [RequestHandle(self, t.request.request_id, t.streaming) for t in tracked]
        for h in handles:
            self._handles[h.request_id] = h
        self._commands.put(("add", tracked))
        self._wake.set()
        return handles

    def _abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        wake: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            if out.finished:
                del self._handles[out.request_id]
            for loop, event in handle._push(out):
                wake.setdefault(loop, []).append(event)
        # One thread-safe call per event loop per step: each is a write to the loop's wake-up
        # pipe, and a streaming server would otherwise make one per request per token.
        for loop, events in wake.items():
            loop.call_soon_threadsafe(_set_all, events)

    def _loop(self) -> None:
        core = self._core
        try:
            while not self._stop:
                while True:
                    try:
                        cmd, arg = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if cmd == "add":
                        for tracked in arg:
                            core.add(tracked)
                    elif cmd == "call":
                        _run_call(core, *arg)
                    else:
                        self._deliver(filter(None, [core.abort(arg, None)]))
                if not core.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._deliver(core.step())
        except BaseException as e:  # noqa: BLE001 - surface the failure to every waiter
            self._error = e
            for rid in list(self._handles):
                self._deliver(filter(None, [core.abort(rid, f"engine thread died: {e!r}")]))
            raise
        finally:
            for rid in list(self._handles):
                self._deliver(filter(None, [core.abort(rid, "engine shut down")]))
            self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "call":
                arg[1].set_exception(RuntimeError("the LLM was shut down before the call ran"))


def kv_usage(core: EngineCore) -> dict[str, dict[str, int]]:
    sched, plan = core.scheduler, core.runner.kv_plan
    return {name: {"used_blocks": pool.num_used_blocks, "total_blocks": pool.num_total_blocks,
                   "peak_used_blocks": pool.peak_used_blocks, "tokens_per_block": plan.tokens_per_block}
            for name, pool in (("self", sched.self_pool), ("cross", sched.cross_pool))}


def reset_kv_peaks(core: EngineCore) -> dict[str, dict[str, int]]:
    """Restart both pools' peaks; returns the usage after. Module level so that an engine process
    can be sent it (``call_on_engine`` pickles)."""
    core.scheduler.self_pool.reset_peak()
    core.scheduler.cross_pool.reset_peak()
    return kv_usage(core)


def _run_call(core: EngineCore, fn, future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(core))
    except Exception as e:  # noqa: BLE001 - the caller gets it; the step loop goes on
        future.set_exception(e)


def batch_of(inputs, sampling_params) -> tuple[bool, list, list]:
    """``generate``'s arguments as (single, prompts, one SamplingParams per prompt), validated."""
    single = not _is_batch(inputs)
    prompts = [inputs] if single else list(inputs)
    if not prompts:
        raise ValueError("generate() got an empty batch: pass at least one prompt")
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
    return single, prompts, params


def wait_all(handles: list[RequestHandle], show_progress: bool) -> list[RequestOutput]:
    """Every handle's result, in order; with a progress bar of finished requests."""
    if not show_progress:
        return [h.result() for h in handles]
    from tqdm.auto import tqdm

    bar = tqdm(total=len(handles), desc="generate", unit="req")
    pending = set(range(len(handles)))
    while pending:
        done = [i for i in pending if handles[i].done()]
        bar.update(len(done))
        pending.difference_update(done)
        if pending:
            time.sleep(0.01)
    bar.close()
    return [h.result() for h in handles]


def _is_batch(inputs) -> bool:
    if isinstance(inputs, (str, dict)):
        return False
    if isinstance(inputs, (list, tuple)):
        return not inputs or not isinstance(inputs[0], int)
    return False
