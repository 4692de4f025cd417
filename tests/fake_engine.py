"""A stand-in with the LLM API's shape for bench tests: ``generate_async`` returns an
awaitable / async-iterable handle of RequestOutputs with RequestMetrics, one token per fixed
step, so bench's loop, metrics and reports are tested without a model."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from enc2dec.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

STEP_S = 0.001
VOCAB = 512


class FakeHandle:
    def __init__(self, llm, prompt, params, streaming):
        self.llm, self.prompt, self.params, self.streaming = llm, prompt, params, streaming
        self.arrival = time.monotonic()

    def _out(self, n, times, finished):
        error = "boom" if finished and self.prompt[0] == 13 else None     # token 13 marks a failing request
        reason = ("abort" if error else "length") if finished else None
        return RequestOutput(f"r{id(self)}", None, list(self.prompt),
                             [CompletionOutput(0, "", [7] * n, reason)], finished,
                             RequestMetrics(self.arrival, self.arrival, times[0] if times else None,
                                            times[-1] if finished else None, 0, list(times)), error)

    async def _steps(self):
        self.llm.in_flight += 1
        self.llm.peak_in_flight = max(self.llm.peak_in_flight, self.llm.in_flight)
        times = []
        try:
            for i in range(self.params.max_tokens):
                await asyncio.sleep(STEP_S)
                times.append(time.monotonic())
                yield self._out(i + 1, times, i + 1 == self.params.max_tokens)
        finally:
            self.llm.in_flight -= 1

    async def aresult(self):
        async for out in self._steps():
            pass
        return out

    def __await__(self):
        return self.aresult().__await__()

    def __aiter__(self):
        return self._steps()


class FakeLLM:
    """The LLM API's shape with a fixed step time; records what it was asked."""

    def __init__(self, args=None, model_type="t5"):
        self.args = args
        self.in_flight = self.peak_in_flight = 0
        self.tokenizer = None
        self.prompts = []
        self.shut_down = False
        self.engine = SimpleNamespace(
            hf_config=SimpleNamespace(model_type=model_type, vocab_size=VOCAB),
            device=SimpleNamespace(type="cpu"), dtype="float32")

    def kv_cache_usage(self):
        # Peaks as the real pools keep them (a poll can miss a short request on a loaded machine).
        return {"self": {"used_blocks": 2 * self.in_flight, "peak_used_blocks": 2 * self.peak_in_flight,
                         "total_blocks": 100, "tokens_per_block": 32},
                "cross": {"used_blocks": self.in_flight, "peak_used_blocks": self.peak_in_flight,
                          "total_blocks": 50, "tokens_per_block": 32}}

    def reset_kv_peaks(self):
        self.peak_in_flight = self.in_flight

    def generate_async(self, prompt, params, streaming=False):
        assert params.ignore_eos and params.temperature == 0
        if any(not 0 <= t < VOCAB for t in prompt):
            raise ValueError(f"prompt token ids are outside the vocabulary [0, {VOCAB})")
        self.prompts.append(list(prompt))
        return FakeHandle(self, prompt, params, streaming)

    def shutdown(self):
        self.shut_down = True
