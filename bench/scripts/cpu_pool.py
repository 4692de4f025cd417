"""What a caller's OpenMP pool costs the CPU engine: decode-step times of flan-t5-small (dummy
weights) while the calling thread holds a pool, with the engine freeing it (the default) and
without. A lab script (bench/scripts is not installed); CPU only.

    python bench/scripts/cpu_pool.py --concurrency 1,4 --rounds 2

Each run is a fresh process: the caller runs one parallel torch op before building the LLM
and again before the timed batches, as a script that prepares its inputs with torch would.
"held" keeps that pool (``release_thread_pool`` stubbed out), "freed" is the engine as shipped.
Prints the median step, the wall time per batch and the steps per batch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, statistics, sys, time, torch
import enc2dec.engine.llm as llm_mod
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.engine_core import EngineCore
if os.environ["POOL"] == "held":
    llm_mod.release_thread_pool = lambda: None
c, batches = int(sys.argv[1]), int(sys.argv[2])
torch.randn(1 << 22).exp_().sum()            # the caller's pool
llm = LLM(model="google/flan-t5-small", load_format="dummy", max_batch_size=max(4, c),
          kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5))
ids = [[100 + i + k for i in range(32)] for k in range(c)]
sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
for _ in range(2):
    llm.generate(ids, sampling_params=sp, use_tqdm=False)
torch.randn(1 << 22).exp_().sum()
steps, step = [], EngineCore.step
def timed(self, *a, **k):
    t = time.perf_counter(); r = step(self, *a, **k); steps.append(time.perf_counter() - t); return r
EngineCore.step = timed
t0 = time.perf_counter()
for _ in range(batches):
    llm.generate(ids, sampling_params=sp, use_tqdm=False)
wall = (time.perf_counter() - t0) / batches
llm.shutdown()
print(json.dumps({"step_ms": statistics.median(steps) * 1e3, "batch_ms": wall * 1e3, "steps": len(steps) / batches}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4", help="prompts per generate() call, a comma list")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each variant, interleaved")
    ap.add_argument("--batches", type=int, default=8, help="timed generate() calls per run")
    a = ap.parse_args()
    print(f"{'C':>3} {'caller pool':<12} {'step ms':>8} {'batch ms':>9} {'steps':>6}")
    for c in map(int, a.concurrency.split(",")):
        for r in range(a.rounds):
            for pool in ("held", "freed"):
                out = subprocess.run([sys.executable, "-c", CHILD, str(c), str(a.batches)], capture_output=True,
                                     text=True, env=dict(os.environ, POOL=pool))
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-2000:])
                m = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{c:>3} {pool:<12} {m['step_ms']:8.2f} {m['batch_ms']:9.1f} {m['steps']:6.1f}", flush=True)


if __name__ == "__main__":
    main()
