"""The engine side of an eval: every example through the started LLM.

Requests go in through ``generate_async`` with a bounded number in flight (the engine
batches them continuously; the bound keeps audio features of a large dataset out of
memory). A prompt the engine rejects (too long for its limits) makes a bad row, not a
failed run.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from .data import BadRow, Example


@dataclass
class EngineResult:
    outputs: dict[int, Any]          # row -> RequestOutput
    rejected: list[BadRow]
    wall_s: float


def make_prompt(example: Example, whisper_prompt: str | None):
    if isinstance(example.source, str):
        return example.source
    return {"prompt": whisper_prompt or "", "multi_modal_data": {"audio": [(example.source, 16000)]}}


def run_engine(llm, examples: list[Example], params, whisper_prompt: str | None, progress,
               max_in_flight: int) -> EngineResult:
    """Every example through the engine; the wall clock runs from the first submission to
    the last result (input processing included, model loading not)."""
    outputs: dict[int, Any] = {}
    rejected: list[BadRow] = []
    pending: dict[int, Any] = {}
    queue = collections.deque(examples)
    progress.start("enc2dec", len(examples))
    start = time.perf_counter()
    while queue or pending:
        while queue and len(pending) < max_in_flight:
            ex = queue.popleft()
            try:
                pending[ex.row] = llm.generate_async(make_prompt(ex, whisper_prompt), params)
            except ValueError as e:
                rejected.append(BadRow(ex.row, "rejected by the engine", str(e)))
                progress.advance(1)
        done = [row for row, handle in pending.items() if handle.done()]
        for row in done:
            outputs[row] = pending.pop(row).result()
        progress.advance(len(done))
        if pending and not done:
            time.sleep(0.005)
    wall_s = time.perf_counter() - start
    progress.stop()
    return EngineResult(outputs, rejected, wall_s)


def warm_up(llm, examples: list[Example], params, whisper_prompt: str | None, count: int) -> None:
    """A few untimed requests: first-call costs (allocator, kernel selection, compilation)."""
    prompts = [make_prompt(ex, whisper_prompt) for ex in examples[:count]]
    if not prompts:
        return
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except ValueError:
        pass      # a rejected prompt shows up, counted, in the measured run
