"""Sweep the skinny GEMV kernel's launch configuration on the shapes of real decoders.

    python bench/scripts/tune_skinny.py [--rows 1] [--json out.json]

For each weight shape of flan-t5-large and whisper-large-v3 (single-row decode steps) it
times every (BLOCK_N, BLOCK_K, num_warps) in the grid and cuBLAS (``F.linear``), each as
100 launches captured in one CUDA graph (as the decoder step replays them), cycling through
enough weight copies to overflow the L2 cache (a step reads every layer's weights once).
Prints microseconds per call, the best configuration per shape and its effective read
bandwidth. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

SHAPES = {  # (N, K) of the decoder's projections at TP=1
    "flan-t5-large": [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (32128, 1024)],
    "whisper-large-v3": [(3840, 1280), (1280, 1280), (5120, 1280), (1280, 5120), (51866, 1280)],
}
GRID = list(itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (1, 2, 4, 8)))
L2_OVERFLOW_BYTES = 256 << 20


def _time(fn, weights, x, launches: int = 100) -> float:
    """Microseconds per call of ``fn(x, w)`` over ``launches`` graph-captured calls."""
    fn(x, weights[0])                                   # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(x, weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * launches)


def main() -> None:
    from enc2dec.kernels import skinny_gemm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--json", help="write every timing here")
    a = ap.parse_args()
    results = []
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            nbytes = n * k * 2
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                       for _ in range(max(2, -(-L2_OVERFLOW_BYTES // nbytes)))]
            x = torch.randn(a.rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "n": n, "k": k, "cublas_us": _time(lambda x, w: F.linear(x, w), weights, x)}
            timings = {}
            for bn, bk, warps in GRID:
                fn = (lambda bn, bk, warps: lambda x, w: skinny_gemm.skinny_linear(
                    x, w, block_n=bn, block_k=bk, num_warps=warps))(bn, bk, warps)
                try:
                    timings[f"{bn},{bk},{warps}"] = _time(fn, weights, x)
                except Exception as e:  # noqa: BLE001 - a configuration that cannot compile is skipped
                    timings[f"{bn},{bk},{warps}"] = None
                    print(f"  {n}x{k} {bn},{bk},{warps}: {type(e).__name__}")
            default = skinny_gemm.launch_config(a.rows, n, k)
            row["default"] = default
            row["default_us"] = _time(lambda x, w: skinny_gemm.skinny_linear(x, w), weights, x)
            best = min((v, c) for c, v in timings.items() if v is not None)
            row["best_us"], row["best"] = best
            row["timings"] = timings
            results.append(row)
            print(f"{model:>17} N={n:>6} K={k:>5}  cuBLAS {row['cublas_us']:6.2f} us  default {default} "
                  f"{row['default_us']:6.2f} us  best {best[1]:>10} {best[0]:6.2f} us "
                  f"({nbytes / best[0] / 1e6:.2f} TB/s)", flush=True)
            del weights
    per_model = {}
    for r in results:
        t = per_model.setdefault(r["model"], [0.0, 0.0, 0.0])
        t[0] += r["cublas_us"]
        t[1] += r["default_us"]
        t[2] += r["best_us"]
    for model, (cub, dflt, best) in per_model.items():
        print(f"{model}: one call per shape, summed: cuBLAS {cub:.1f} us, default {dflt:.1f} us, best {best:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
