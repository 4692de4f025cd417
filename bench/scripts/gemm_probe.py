"""How far a decode step's multi-row products are from the weight read, per BLAS backend.

    python bench/scripts/gemm_probe.py [--rows 64,128,256] [--json out.json]

Issue 19's steps at C=64-256 are ~45% cuBLAS products (profile_step.py), each far below the
bandwidth its weight read would allow. For every decoder projection of flan-t5-large,
bart-large-cnn and whisper-large-v3 (TP=1, bf16) and each row count, it times ``F.linear``
under torch's cuBLAS and cuBLASLt backends, 100 graph-captured calls cycling through enough
weight copies to overflow the L2 (as a step reads every layer once), and prints microseconds a
call, the weight-read rate, and per model a step's sum over its layers against the same bytes
at the copy rate ``--tbps``. A lab script (bench/scripts is not installed); needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tune_skinny import L2_OVERFLOW_BYTES, _time

# (N, K, calls a step) of each decoder projection; the head once a step.
MODELS = {
    "flan-t5-large": [(3072, 1024, 24), (1024, 1024, 24), (1024, 1024, 24), (1024, 1024, 24),
                      (5632, 1024, 24), (1024, 2816, 24), (32128, 1024, 1)],
    "bart-large-cnn": [(3072, 1024, 12), (1024, 1024, 12), (1024, 1024, 12), (1024, 1024, 12),
                       (4096, 1024, 12), (1024, 4096, 12), (50264, 1024, 1)],
    "whisper-large-v3": [(3840, 1280, 32), (1280, 1280, 32), (1280, 1280, 32), (1280, 1280, 32),
                         (5120, 1280, 32), (1280, 5120, 32), (51866, 1280, 1)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--tbps", type=float, default=4.3, help="the copy rate to compare with (H200: 4.3)")
    ap.add_argument("--json")
    a = ap.parse_args()
    backends = ["cublas", "cublaslt"]
    results, times = [], {}
    for n, k in sorted({(n, k) for shapes in MODELS.values() for n, k, _ in shapes}):
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(2, -(-L2_OVERFLOW_BYTES // nbytes)))]
        for rows in map(int, a.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "rows": rows, "bound_us": nbytes / (a.tbps * 1e6)}
            for be in backends:
                torch.backends.cuda.preferred_blas_library(be)
                row[be] = times[(n, k, rows, be)] = _time(lambda x, w: F.linear(x, w), weights, x)
            results.append(row)
            print(f"N={n:>6} K={k:>5} rows={rows:>4}  bound {row['bound_us']:6.2f} us  " + "  ".join(
                f"{be} {row[be]:6.2f} us ({nbytes / row[be] / 1e6:.2f} TB/s)" for be in backends), flush=True)
        del weights
    torch.backends.cuda.preferred_blas_library("cublas")
    print(f"\n{'model':<18}{'rows':>5}{'bound ms':>10}" + "".join(f"{be + ' ms':>13}" for be in backends))
    for model, shapes in MODELS.items():
        for rows in map(int, a.rows.split(",")):
            bound = sum(n * k * 2 * c for n, k, c in shapes) / (a.tbps * 1e9)
            sums = [sum(times[(n, k, rows, be)] * c for n, k, c in shapes) / 1e3 for be in backends]
            print(f"{model:<18}{rows:>5}{bound:>10.3f}" + "".join(f"{s:>13.3f}" for s in sums))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
