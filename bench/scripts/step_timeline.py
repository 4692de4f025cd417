"""The engine's steps one by one under bench's closed loop: where a run's time goes between
encoder and decoder work, and how the first wave reaches its first tokens.

    python bench/scripts/step_timeline.py --model google/flan-t5-base --concurrency 256 --num-requests 512
    python bench/scripts/step_timeline.py --model openai/whisper-large-v3-turbo --concurrency 64 --output-len 96

A lab script (bench/scripts is not installed); dummy weights, bf16 on a GPU. One warm-up wave,
then ``--num-requests`` requests with C in flight (as ``enc2dec bench`` keeps them), every
``EngineCore.step`` timed with the rows it launched, the requests it encoded (in the step or
beside it) and the time it waited for the device. Prints the first steps of the measured
window, the steps grouped by kind (decode only, decode + encode, encode only) and the first
wave's TTFT against the time its last request was submitted. A diagnosis tool, not a
benchmark: performance claims come from ``enc2dec bench``.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import time

import numpy as np

from enc2dec.bench.audio import synthetic_clip, whisper_prompt
from enc2dec.engine import LLM, KvCacheConfig, LlmArgs, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="google/flan-t5-base")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--first", type=int, default=12, help="steps of the measured window printed one by one")
    a = ap.parse_args()

    args = LlmArgs.from_dict({}, model=a.model, load_format="dummy", dtype=a.dtype, max_batch_size=a.concurrency,
                             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5))
    llm = LLM.from_args(args)
    core = llm.engine
    rng = np.random.default_rng(0)
    if core.is_whisper:
        clips = [whisper_prompt(synthetic_clip(30.0, i)) for i in range(min(a.num_requests, 64))]
        prompts = [clips[i % len(clips)] for i in range(a.num_requests)]
    else:
        vocab = core.hf_config.vocab_size
        prompts = [rng.integers(10, min(30000, vocab - 1), a.input_len).tolist() for _ in range(a.num_requests)]
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)

    log: list[tuple] = []           # (start_s, step_s, rows, encodes, beside, device_wait_s)
    real_step, real_schedule = core.step, core.scheduler.schedule
    last = {}

    def schedule():
        so = real_schedule()
        last["so"] = so
        return so

    def step():
        c0 = core.counters.device_wait_s
        last["so"] = None
        t0 = time.perf_counter()
        out = real_step()
        so = last["so"]
        rows, enc, beside = (len(so.seqs), len(so.encodes), bool(so.encode_ticket)) if so is not None else (0, 0, False)
        log.append((t0, time.perf_counter() - t0, rows, enc, beside, core.counters.device_wait_s - c0))
        return out

    core.scheduler.schedule, core.step = schedule, step

    async def closed_loop(reqs):
        it = iter(reqs)
        outs, submit = [], {}

        async def worker():
            for p in it:
                i = len(submit)
                submit[i] = time.perf_counter()
                outs.append((i, await llm.generate_async(p, sp)))

        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        return outs, submit

    asyncio.run(closed_loop(prompts[:a.concurrency]))          # warm-up wave
    log.clear()
    t_start = time.perf_counter()
    mono0 = time.monotonic()
    outs, submit = asyncio.run(closed_loop(prompts))
    wall = time.perf_counter() - t_start
    llm.shutdown()

    tokens = sum(len(o.outputs[0].token_ids) for _, o in outs)
    print(f"\n{a.model} C={a.concurrency} requests={a.num_requests} in={a.input_len} out={a.output_len}: "
          f"{tokens / wall:,.0f} out tok/s, {len(log)} steps in {wall:.2f} s")
    print(f"\nfirst {a.first} steps (ms from the first submit):")
    print(f"{'start':>8}{'step ms':>9}{'rows':>6}{'enc':>5}{'beside':>8}{'wait ms':>9}")
    for t0, dt, rows, enc, beside, wait in log[:a.first]:
        print(f"{1e3 * (t0 - t_start):>8.1f}{1e3 * dt:>9.2f}{rows:>6}{enc:>5}{'yes' if beside else '':>8}{1e3 * wait:>9.2f}")

    kinds = collections.defaultdict(list)
    for _, dt, rows, enc, beside, wait in log:
        kind = "encode only" if enc and not rows else ("decode + encode beside" if enc and beside else
                                                       "decode + encode in step" if enc else "decode only")
        kinds[kind].append((dt, rows, enc, wait))
    print(f"\n{'kind':<26}{'steps':>7}{'ms each':>9}{'total s':>9}{'rows':>7}{'enc':>6}{'wait %':>8}")
    for kind, xs in sorted(kinds.items()):
        dts = [x[0] for x in xs]
        print(f"{kind:<26}{len(xs):>7}{1e3 * np.mean(dts):>9.2f}{sum(dts):>9.2f}{np.mean([x[1] for x in xs]):>7.1f}"
              f"{np.mean([x[2] for x in xs]):>6.1f}{100 * sum(x[3] for x in xs) / max(sum(dts), 1e-9):>8.0f}")
    busy = sum(x[1] for x in log)
    print(f"in steps {busy:.2f} s of {wall:.2f} s wall ({100 * busy / wall:.0f}%)")

    # The first wave: the C requests submitted first.
    first = sorted(outs)[:a.concurrency]
    ttft = [1e3 * (o.metrics.first_token_time - mono0) for _, o in first if o.metrics.first_token_time]
    last_submit = 1e3 * (max(submit[i] for i, _ in first) - t_start)
    print(f"first wave: last submitted at {last_submit:.1f} ms; first tokens from {min(ttft):.1f} to "
          f"{max(ttft):.1f} ms (median {np.median(ttft):.1f})")


if __name__ == "__main__":
    main()
