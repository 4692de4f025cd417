"""The engine side of an eval: build the LLM from the options, run every example.

Requests go in through ``generate_async`` with a bounded number in flight (the engine
batches them continuously; the bound keeps audio features of a large dataset out of
memory). A prompt the engine rejects (too long for its limits) makes a bad row, not a
failed run.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from .data import BadRow, Example
from .errors import EvalInputError

DEFAULT_CROSS_KV_FRACTION = 0.5


def _config_sets(config: str, key: str) -> bool:
    import yaml

    try:
        with open(config) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False         # from_yaml reports the problem with the file
    return isinstance(data, dict) and key in data


def build_llm_args(model: str, config: str | None, overrides: dict[str, Any], default_max_batch_size: int):
    """LlmArgs from the YAML (if any) and the command-line options, which win. When neither
    sets them, ``max_batch_size`` is eval's batch size and ``kv_cache_config.cross_kv_cache_fraction``
    is 0.5."""
    from enc2dec.engine import LlmArgs

    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "max_batch_size" not in overrides and not (config and _config_sets(config, "max_batch_size")):
        overrides["max_batch_size"] = default_max_batch_size
    try:
        args = LlmArgs.from_yaml(config, model=model, **overrides) if config else \
            LlmArgs.from_dict({}, model=model, **overrides)
        if args.kv_cache_config.cross_kv_cache_fraction is None:
            kv = dataclasses.replace(args.kv_cache_config, cross_kv_cache_fraction=DEFAULT_CROSS_KV_FRACTION)
            args = dataclasses.replace(args, kv_cache_config=kv)
    except ValueError as e:
        raise EvalInputError(f"--config {config}: {e}" if config else str(e)) from None
    return args


def start_llm(args):
    from enc2dec.engine import LLM

    try:
        return LLM.from_args(args)
    except ValueError as e:
        raise EvalInputError(f"cannot start the engine for {args.model}: {e}") from None


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
