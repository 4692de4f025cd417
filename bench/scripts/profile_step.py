"""Where a GPU step's time goes: torch.profiler over one static batch, kernels grouped by name.

    python bench/scripts/profile_step.py --model google/flan-t5-large --concurrency 1 --output-len 64
    python bench/scripts/profile_step.py --model openai/whisper-large-v3 --concurrency 64 --graphs off
    python bench/scripts/profile_step.py --concurrency 64 --temperature 0.8 --top-p 0.95 --seed 0

Prints wall time per generated token step, the GPU's busy time per step (the union of kernel
intervals; their summed durations beside it, larger where programmatic launch overlaps them),
kernels launched per step, and the top kernels by total time. A diagnosis tool
for the GPU fast path, not a benchmark: performance claims come from `enc2dec bench`.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from enc2dec.bench.audio import synthetic_clip, whisper_prompt
from enc2dec.engine import LLM, KvCacheConfig, LlmArgs, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="google/flan-t5-large")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--graphs", choices=["on", "off"], default="on")
    ap.add_argument("--overlap", choices=["on", "off"], default="on")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0 profiles the sampled step")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None, help="seeded sampling (one stream per request)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--dtype", default="bfloat16", help="float32: what the CPU runs by default")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="write the kernel table here")
    ap.add_argument("--cpu-profile", action="store_true",
                    help="instead: cProfile the engine's host side in a closed loop (C requests in flight)")
    a = ap.parse_args()

    extra = {} if a.graphs == "on" else {"cuda_graph_config": None}
    args = LlmArgs.from_dict(extra, model=a.model, load_format="dummy", dtype=a.dtype,
                             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, dtype=a.kv_cache_dtype),
                             disable_overlap_scheduler=a.overlap == "off")
    if a.cpu_profile:
        return cpu_profile(args, a)
    llm = LLM.from_args(args)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    make_prompt = _prompt_maker(llm.engine, a.input_len)
    prompts = [make_prompt() for _ in range(a.concurrency)]
    sp = _params(a)
    llm.generate(prompts, sp, use_tqdm=False)                           # warm-up
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    sync()
    wall_plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t0
    llm.shutdown()

    kernels = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            spans.append((ev.time_range.start, ev.time_range.end))
    steps = a.output_len
    busy_us = sum(v[1] for v in kernels.values())
    count = sum(v[0] for v in kernels.values())
    # Programmatically launched kernels start (and wait on the GPU) while the one before them
    # runs, so their durations overlap and their sum overstates the time the GPU was busy.
    union_us, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            union_us += stop - max(start, end)
            end = stop
    print(f"\n{a.model} C={a.concurrency} graphs={a.graphs} overlap={a.overlap} out={a.output_len} "
          f"temperature={a.temperature} top_p={a.top_p} top_k={a.top_k} seed={a.seed} kv={a.kv_cache_dtype}")
    print(f"wall {wall_plain * 1e3:.1f} ms unprofiled ({wall_plain * 1e3 / steps:.3f} ms/step), "
          f"{wall * 1e3:.1f} ms profiled; GPU busy {union_us / 1e3:.1f} ms ({union_us / 1e3 / steps:.3f} ms/step; "
          f"kernel times summed {busy_us / 1e3 / steps:.3f} ms/step); {count} kernels ({count / steps:.0f}/step)")
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:a.top]
    print(f"{'kernel':<90} {'calls':>7} {'total ms':>9} {'us/call':>8} {'%':>5}")
    for name, (n, us) in rows:
        print(f"{name:<90} {n:>7} {us / 1e3:>9.2f} {us / n:>8.1f} {100 * us / busy_us:>5.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, concurrency=a.concurrency, graphs=a.graphs, overlap=a.overlap,
                           temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                           output_len=a.output_len, wall_ms=wall_plain * 1e3, busy_ms=union_us / 1e3,
                           kernel_ms=busy_us / 1e3,
                           kernels=[dict(name=n, calls=c, total_us=t) for n, (c, t) in rows]), f, indent=1)


def _params(a) -> SamplingParams:
    return SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, seed=a.seed, detokenize=False)


def _prompt_maker(core, input_len: int):
    """Prompts for ``core``'s model: 30 s synthetic clips for Whisper (bench's own), else
    ``input_len`` random token ids inside the vocabulary."""
    rng = np.random.default_rng(0)
    if core.is_whisper:
        seeds = iter(range(1 << 30))
        return lambda: whisper_prompt(synthetic_clip(30.0, next(seeds)))
    vocab = core.hf_config.vocab_size
    return lambda: rng.integers(10, min(30000, vocab - 1), input_len).tolist()


def cpu_profile(args, a) -> None:
    """The engine loop on this thread under cProfile, refilled to C requests as they finish."""
    import cProfile
    import pstats

    from enc2dec.engine.engine_core import EngineCore

    core = EngineCore(args)
    prompt = _prompt_maker(core, a.input_len)
    sp = _params(a)

    def loop(num_requests):
        done = started = steps = 0
        while done < num_requests:
            while started - done < a.concurrency and started < num_requests:
                core.add(core.make_request(prompt(), sp))
                started += 1
            done += sum(o.finished for o in core.step())
            steps += 1
        return steps

    loop(a.concurrency)                                             # warm-up
    n = 2 * a.concurrency
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = loop(n)
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"\n{a.model} C={a.concurrency}: {n} requests, {steps} steps, {wall * 1e3 / steps:.3f} ms/step "
          f"under cProfile, {n * a.output_len / wall:,.0f} out tok/s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
