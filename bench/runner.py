"""The in-process engine as a bench target: ``LLM.generate_async`` under the closed loop.

Timing: without streaming, a request's token arrivals are the engine's own per-step
timestamps (``RequestMetrics.token_times``, the bench's monotonic clock, since the engine
runs in this process); with ``streaming`` they are the times the client received each
streamed update. E2E always ends when the client holds the final output.
"""
from __future__ import annotations

import asyncio
import time

# The session starts engines through this module's name (the tests put a fake engine there).
from enc2dec.engine.launch import start_llm  # noqa: F401

from .errors import BenchInputError
from .metrics import RequestRecord, step_extras
from .workloads import BenchRequest


class KvTracker:
    """Peak KV blocks in use while a level runs: the pools' own high-water marks, restarted at the
    level's start (``LLM.reset_kv_peaks``), and, for engines without them, ``kv_cache_usage()``
    polled, which can miss requests shorter than its interval."""

    def __init__(self, llm):
        usage = getattr(llm, "kv_cache_usage", None)
        self._usage = usage if callable(usage) else None
        reset = getattr(llm, "reset_kv_peaks", None)
        if self._usage is not None and callable(reset):
            reset()
        first = self._usage() if self._usage else {}
        self.self_total = first.get("self", {}).get("total_blocks")
        self.cross_total = first.get("cross", {}).get("total_blocks")
        self.self_peak = self.cross_peak = 0

    def sample(self) -> None:
        if self._usage is None:
            return
        usage = self._usage()
        for pool in ("self", "cross"):
            u = usage[pool]
            peak = max(getattr(self, f"{pool}_peak"), u["used_blocks"], u.get("peak_used_blocks", 0))
            setattr(self, f"{pool}_peak", peak)

    async def poll(self, interval_s: float = 0.01) -> None:
        while True:
            self.sample()
            await asyncio.sleep(interval_s)

    def extras(self) -> dict:
        if self._usage is None:
            return {}
        return {"kv_self_blocks_peak": self.self_peak, "kv_self_blocks_total": self.self_total,
                "kv_cross_blocks_peak": self.cross_peak, "kv_cross_blocks_total": self.cross_total}


def _cuda_device(llm):
    from enc2dec.engine.engine_process import EngineSnapshot

    core = getattr(llm, "engine", None)
    if isinstance(core, EngineSnapshot):       # the engine's memory is another process's: nothing to read here
        return None
    device = getattr(core, "device", None)
    return device if getattr(device, "type", None) == "cuda" else None


class EngineTarget:
    name = "enc2dec"

    def __init__(self, llm, streaming: bool = False, beam_width: int = 1):
        self.llm = llm
        self.streaming = streaming
        self.beam_width = beam_width
        self._kv: KvTracker | None = None
        self._poller: asyncio.Task | None = None
        self._steps_before: dict | None = None

    @property
    def tokenizer(self):
        return getattr(self.llm, "tokenizer", None)

    async def begin_level(self) -> None:
        device = _cuda_device(self.llm)
        if device is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(device)
        self._kv = KvTracker(self.llm)
        self._steps_before = self._step_counters()
        self._poller = asyncio.ensure_future(self._kv.poll())

    def _step_counters(self) -> dict | None:
        stats = getattr(self.llm, "stats", None)
        return stats().get("steps") if callable(stats) else None

    async def end_level(self) -> dict:
        if self._poller is not None:
            self._poller.cancel()
        extras = {}
        if self._kv is not None:
            self._kv.sample()
            extras.update(self._kv.extras())
        extras.update(step_extras(self._steps_before, self._step_counters()))
        device = _cuda_device(self.llm)
        if device is not None:
            import torch

            extras["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return extras

    async def send(self, req: BenchRequest) -> RequestRecord:
        from enc2dec.engine import SamplingParams

        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, **({"temperature": 0.0} | req.sampling),
                                use_beam_search=self.beam_width > 1, best_of=self.beam_width, n=1)
        rec = RequestRecord(start_s=time.monotonic(), input_len=req.input_len, audio_s=req.audio_s, kind=req.kind)
        try:
            handle = self.llm.generate_async(req.prompt, params, streaming=self.streaming)
        except ValueError as e:
            raise BenchInputError(f"{req.source}: the engine rejected the request: {e}") from None
        final, seen = None, 0
        if self.streaming:
            async for out in handle:
                n = len(out.outputs[0].token_ids) if out.outputs else 0
                if n > seen:
                    rec.token_times_s.append(time.monotonic())
                    seen = n
                final = out
        else:
            final = await handle
            m = final.metrics
            rec.token_times_s = list(m.token_times) or ([m.first_token_time] if m.first_token_time else [])
        rec.end_s = time.monotonic()
        _fill_from_output(rec, final)
        return rec

    def close(self) -> None:
        self.llm.shutdown()


def _fill_from_output(rec: RequestRecord, final) -> None:
    if final is None:
        rec.error = "the engine returned no output"
        return
    if final.prompt_token_ids:
        rec.input_len = len(final.prompt_token_ids)
    outputs = final.outputs or []
    rec.output_len = len(outputs[0].token_ids) if outputs else 0
    rec.num_preemptions = getattr(final.metrics, "num_preemptions", 0) or 0
    reason = outputs[0].finish_reason if outputs else None
    if final.error:
        rec.error = str(final.error)
    elif not final.finished or reason == "abort" or not outputs:
        rec.error = f"request {final.request_id} ended without finishing (finish_reason={reason})"
    elif rec.output_len == 0:
        rec.error = f"request {final.request_id} produced no tokens"
