"""One bench run: bench the target at every concurrency level, then each baseline on the
same requests; collect the records and the run's metadata.

The target is the in-process engine, or a server with ``--url``. The engine is shut down
before the baselines start, so they get the GPU memory its KV pools held.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from .errors import BenchInputError
from .http_shards import ShardedHttpTarget, auto_client_processes
from .loop import Progress, closed_loop
from .metrics import LevelMetrics, compute_level
from .options import BenchOptions, _split_warmup, build_workload, cycle_requests
from .thresholds import check_thresholds
from .whisper_rules import apply_rules
from .workloads import BenchRequest

__all__ = ["BenchOptions", "BenchResult", "run_bench"]


@dataclass
class BenchResult:
    levels: list[LevelMetrics]
    meta: dict
    primary: str
    misses: list[str]

    @property
    def num_failed(self) -> int:
        return sum(lv.failed for lv in self.levels)

    @property
    def exit_code(self) -> int:
        return 1 if self.misses or self.num_failed else 0


async def _bench_target(target, reqs: list[BenchRequest], opts: BenchOptions, progress: Progress,
                        on_level: Callable[[LevelMetrics], None]) -> None:
    warm, measured = _split_warmup(reqs, opts.warmup)
    # A target may run the closed loop itself (bench --url from several client processes).
    run_loop = getattr(target, "closed_loop", None) or (lambda *a: closed_loop(target.send, *a))
    for c in opts.concurrency:
        if warm:
            # At least one full wave at the level's concurrency, as the baselines warm one batch of
            # each size: first-use work for the level's batch shapes (kernel compiles) must not
            # land in the measured window, where on a fresh machine it can cost half the
            # throughput (docs/benchmarks.md).
            wave = cycle_requests(reqs, max(len(warm), c))
            progress.start(f"{target.name} C={c} warm-up", len(wave))
            await run_loop(wave, c, len(wave), None, progress)
        n = opts.level_num_requests(c)
        progress.start(f"{target.name} C={c}", n)
        await target.begin_level()
        try:
            records, duration = await run_loop(measured, c, n, opts.duration_s, progress)
        finally:
            extras = await target.end_level()
        on_level(compute_level(target.name, c, records, duration, **extras))


def _local_vocab_size(model: str | None) -> int | None:
    """With --url, the vocabulary of --model where it is readable here without the hub (a
    folder's config.json, or a name in the known-config table), so synthetic prompt ids stay
    inside it; None: the range every usual vocabulary has."""
    if not model:
        return None
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return int(json.load(f).get("vocab_size") or 0) or None
        except (OSError, ValueError, TypeError):
            return None
    from enc2dec.engine.inputs.known_configs import KNOWN_MODELS, get_known_config

    return getattr(get_known_config(model), "vocab_size", None) if model in KNOWN_MODELS else None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("enc2dec", "torch", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = _source_version() if pkg == "enc2dec" else None
    return out


def _source_version() -> str | None:
    """enc2dec run from a source tree without being installed: pyproject's version, marked."""
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "pyproject.toml")
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', open(path).read(), re.M)
    except OSError:
        return None
    return f"{m.group(1)}+source" if m else None


def _device_info(device, url: str | None) -> dict:
    info = {"target": url or "in-process"}
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        info.update(type="cuda", name=torch.cuda.get_device_name(device))
    else:
        info.update(type="cpu", name=f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    return info


def _row_defaults(opts: BenchOptions) -> dict:
    """A decoder row for every request in flight at the top level (each beam is a row), where
    neither the config nor the command line sizes ``max_batch_size``: C=256 must not run as 128
    rows and a queue. An explicit smaller value is kept (queueing is then what is measured), except
    that beam search raises it in any case (below)."""
    from enc2dec.engine.config import LlmArgs

    rows = max(opts.concurrency) * opts.beam_width
    default = next(f.default for f in dataclasses.fields(LlmArgs) if f.name == "max_batch_size")
    return {"max_batch_size": rows} if rows > default else {}


def run_bench(opts: BenchOptions, progress: Progress | None = None,
              on_level: Callable[[list[LevelMetrics], dict], None] | None = None) -> BenchResult:
    """Runs the whole bench; ``on_level(levels_so_far, meta)`` after every level (partial reports)."""
    opts.validate()
    return _Run(opts, progress or Progress(), on_level).run()


class _Run:
    def __init__(self, opts: BenchOptions, progress: Progress, on_level):
        self.opts, self.progress, self._on_level = opts, progress, on_level
        self.primary = "http" if opts.url is not None else "enc2dec"
        self.levels: list[LevelMetrics] = []
        self.meta: dict = {
            "command": opts.command or shlex.join(["enc2dec", *sys.argv[1:]]),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(), "model": opts.model, "load_format": opts.load_format,
            "concurrency": list(opts.concurrency),
            "num_requests": [opts.level_num_requests(c) for c in opts.concurrency],
            "duration_s": opts.duration_s, "warmup": opts.warmup, "streaming": opts.streaming,
            "baselines": list(opts.baselines), "thresholds": [str(t) for t in opts.thresholds]}

    def add(self, level: LevelMetrics) -> None:
        self.levels.append(level)
        order = {name: i for i, name in enumerate([self.primary, *self.opts.baselines])}
        self.levels.sort(key=lambda lv: (lv.concurrency, order.get(lv.backend, 99)))
        if self._on_level is not None:
            self._on_level(list(self.levels), self.meta)

    def run(self) -> BenchResult:
        try:
            if self.opts.url is not None:
                reqs, device, dtype = self._run_http()
            else:
                reqs, device, dtype = self._run_engine()
            self._run_baselines(reqs, device, dtype)
        finally:
            self.progress.stop()
        misses = check_thresholds(list(self.opts.thresholds),
                                  [lv for lv in self.levels if lv.backend == self.primary])
        self.meta["threshold_misses"] = misses
        return BenchResult(self.levels, self.meta, self.primary, misses)

    def _run_engine(self):
        from enc2dec.engine.launch import build_llm_args

        from . import runner

        opts, meta = self.opts, self.meta
        overrides = dict(opts.engine_overrides, load_format=opts.load_format, dtype=opts.dtype, device=opts.device)
        try:
            args = build_llm_args(opts.model, opts.config, defaults=_row_defaults(opts), **overrides)
        except ValueError as e:
            raise BenchInputError(f"engine config: {e}") from None
        # Dummy Whisper has no tokenizer: the stand-in transcribe uses encodes the decoder
        # prompts of --timestamps / --detect-language, and every run detokenizes the same way
        # (as a real checkpoint's would), so plain and timestamped runs compare like for like.
        from enc2dec.engine.whisper.tokens import with_stand_in_tokenizer

        args = with_stand_in_tokenizer(args)
        if opts.beam_width > 1:
            # Reserve the beams, and a decoder row for each beam of every request in flight.
            args = dataclasses.replace(args, max_beam_width=max(args.max_beam_width, opts.beam_width),
                                       max_batch_size=max(args.max_batch_size, max(opts.concurrency) * opts.beam_width))
        try:
            llm = runner.start_llm(args)
        except ValueError as e:
            raise BenchInputError(str(e)) from None
        try:
            core = getattr(llm, "engine", None)
            hf_config = getattr(core, "hf_config", None)
            is_whisper = getattr(hf_config, "model_type", None) == "whisper"
            reqs, meta["workload"] = build_workload(opts, is_whisper, getattr(hf_config, "vocab_size", None))
            reqs = apply_rules(reqs, llm, opts.timestamps_every, opts.detect_language)
            if llm.tokenizer is None and any(r.is_text for r in reqs):
                raise BenchInputError(f"{next(r.source for r in reqs if r.is_text)}: a text prompt needs a "
                                      f"tokenizer, and {opts.model} has none (dummy weights); use input_ids rows")
            device, dtype = getattr(core, "device", None), getattr(core, "dtype", None)
            if "hf-compile" in opts.baselines and getattr(device, "type", "cpu") != "cuda":
                raise BenchInputError("--baseline hf-compile needs a CUDA GPU (transformers compiles generate's "
                                      "forward only there); use --baseline hf on the CPU")
            meta.update(device=_device_info(device, None), dtype=str(dtype).replace("torch.", ""),
                        load_format=args.load_format,
                        engine_args={k: v for k, v in dataclasses.asdict(args).items() if k != "tokenizer"})
            limits = getattr(core, "limits", None)
            if dataclasses.is_dataclass(limits):   # the scheduler's limits, tuning's auto values resolved
                meta["engine_limits"] = dataclasses.asdict(limits)
            target = runner.EngineTarget(llm, opts.streaming, opts.beam_width)
            asyncio.run(_bench_target(target, reqs, opts, self.progress, self.add))
        finally:
            llm.shutdown()
        return reqs, device, dtype

    def _run_http(self):
        from .http_client import HttpTarget

        opts, meta = self.opts, self.meta
        reqs, meta["workload"] = build_workload(opts, opts.is_audio_requested, _local_vocab_size(opts.model))
        meta.update(device=_device_info(None, opts.url), dtype=opts.dtype)

        async def main():
            c_max = max(opts.concurrency)
            target = HttpTarget(opts.url, opts.model, c_max, opts.streaming, beam_width=opts.beam_width)
            try:
                await target.connect(opts.ready_timeout_s, self.progress)
                meta["model"] = target.model
                k = opts.client_processes or auto_client_processes(c_max)
                meta["client_processes"] = k
                if k > 1:
                    target = ShardedHttpTarget(target, k)
                await _bench_target(target, reqs, opts, self.progress, self.add)
            finally:
                await target.aclose()

        asyncio.run(main())
        return reqs, None, None

    def _run_baselines(self, reqs, device, dtype) -> None:
        opts = self.opts
        if not opts.baselines:
            return
        from .hf_baseline import HfBaseline, resolve_device_dtype

        if device is None:          # --url: the baseline runs here, by the engine's device/dtype rule
            from enc2dec.engine.inputs.model_source import resolve_model

            cfg = resolve_model(opts.model, None, opts.load_format or "auto").hf_config
            device, dtype = resolve_device_dtype(opts.device or "auto", opts.dtype or "auto", cfg)
        self.meta.update(baseline_device=str(device), baseline_dtype=str(dtype).replace("torch.", ""))
        for kind in opts.baselines:
            base = HfBaseline(kind, opts.model, opts.load_format or "auto", device, dtype, opts.beam_width)
            try:
                for c in opts.concurrency:
                    n = opts.level_num_requests(c)
                    self.progress.start(f"{kind} C={c}", n)
                    records, duration, extras = base.run_level(reqs, c, n, opts.duration_s, opts.warmup,
                                                               self.progress)
                    self.add(compute_level(kind, c, records, duration, **extras))
            finally:
                base.close()

