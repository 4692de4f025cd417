"""How far a decode step's multi-row products are from the weight read, per BLAS backend.

    python bench/scripts/gemm_probe.py [--rows 64,128,256] [--triton] [--json out.json]

Issue 19's steps at C=64-256 are ~45% cuBLAS products (profile_step.py), each far below the
bandwidth its weight read would allow. For every decoder projection of flan-t5-large,
bart-large-cnn and whisper-large-v3 (TP=1, bf16) and each row count, it times ``F.linear``
under torch's cuBLAS and cuBLASLt backends, 100 graph-captured calls cycling through enough
weight copies to overflow the L2 (as a step reads every layer once), and prints microseconds a
call, the weight-read rate, and per model a step's sum over its layers against the same bytes
at the copy rate ``--tbps``. ``--triton``: also a candidate with more programs than cuBLAS's
128-wide tiles give these shapes (a 1024 x 1024 product at 64 rows is 8 tiles on 132 SMs):
``BLOCK_M`` 64 rows by ``BLOCK_N`` 16-64 features, the K loop optionally split over ``SPLIT_K``
programs that add into a zeroed float32 buffer (the zeroing and the cast to bf16 are timed with
it), each configuration's time and the best per shape. Measured in session 33
(docs/benchmarks.md): no faster than cuBLAS; a product's ~4 us here is fixed latency, not tiles. A lab script (bench/scripts is not installed); needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tune_skinny import L2_OVERFLOW_BYTES, _time

try:
    import triton
    import triton.language as tl
except ImportError:        # the cuBLAS rows still run
    triton = None

# (N, K, calls a step) of each decoder projection; the head once a step.
MODELS = {
    "flan-t5-large": [(3072, 1024, 24), (1024, 1024, 24), (1024, 1024, 24), (1024, 1024, 24),
                      (5632, 1024, 24), (1024, 2816, 24), (32128, 1024, 1)],
    "bart-large-cnn": [(3072, 1024, 12), (1024, 1024, 12), (1024, 1024, 12), (1024, 1024, 12),
                       (4096, 1024, 12), (1024, 4096, 12), (50264, 1024, 1)],
    "whisper-large-v3": [(3840, 1280, 32), (1280, 1280, 32), (1280, 1280, 32), (1280, 1280, 32),
                         (5120, 1280, 32), (1280, 5120, 32), (51866, 1280, 1)],
}


if triton is not None:
    @triton.jit
    def _tile_gemm(x_ptr, w_ptr, out_ptr, M, N, k_len, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        # out[M, N] (+)= x[M, K] @ w[N, K].T over this program's k_len of K (K = k_len * SPLIT_K,
        # k_len % BLOCK_K == 0).
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            offs_k = pid_k * k_len + k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_n[None, :], other=0.0)
            acc += tl.dot(a, b)
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptrs, acc, mask=mask)


def tile_linear(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, split_k: int,
                num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    block_m = 64 if m >= 64 else 16
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if split_k == 1 else \
        torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _tile_gemm[grid](x, w, out, m, n, k // split_k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    return out if split_k == 1 else out.to(x.dtype)


TILE_CONFIGS = [(bn, bk, sk) for bn in (16, 32, 64) for bk in (64, 128, 256) for sk in (1, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--tbps", type=float, default=4.3, help="the copy rate to compare with (H200: 4.3)")
    ap.add_argument("--models", default=",".join(MODELS), help="a comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--triton", action="store_true", help="also time the Triton tile candidate")
    ap.add_argument("--json")
    a = ap.parse_args()
    backends = ["cublas", "cublaslt"]
    shown = backends + (["triton"] if a.triton else [])
    models = {m: MODELS[m] for m in a.models.split(",")}
    row_counts = [int(r) for r in a.rows.split(",")]
    results, times = [], {}
    for n, k in sorted({(n, k) for shapes in models.values() for n, k, _ in shapes}):
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(2, -(-L2_OVERFLOW_BYTES // nbytes)))]
        for rows in row_counts:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "rows": rows, "bound_us": nbytes / (a.tbps * 1e6)}
            for be in backends:
                torch.backends.cuda.preferred_blas_library(be)
                row[be] = times[(n, k, rows, be)] = _time(lambda x, w: F.linear(x, w), weights, x)
            if a.triton:
                ref = F.linear(x, weights[0]).float()
                tiles = {}
                for bn, bk, sk in TILE_CONFIGS:
                    if k % (bk * sk):
                        continue
                    fn = (lambda bn, bk, sk: lambda x, w: tile_linear(x, w, bn, bk, sk))(bn, bk, sk)
                    err = (fn(x, weights[0]).float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        raise AssertionError(f"tile {bn},{bk},{sk} off by {err} on {n}x{k}")
                    tiles[f"{bn},{bk},{sk}"] = _time(fn, weights, x)
                best = min(tiles, key=tiles.get)
                row["tiles"], row["tile_best"] = tiles, best
                row["triton"] = times[(n, k, rows, "triton")] = tiles[best]
            results.append(row)
            print(f"N={n:>6} K={k:>5} rows={rows:>4}  bound {row['bound_us']:6.2f} us  " + "  ".join(
                f"{be} {row[be]:6.2f} us ({nbytes / row[be] / 1e6:.2f} TB/s)" for be in shown)
                + (f"  best tile {row['tile_best']}" if a.triton else ""), flush=True)
        del weights
    torch.backends.cuda.preferred_blas_library("cublas")     # torch's default again
    print(f"\n{'model':<18}{'rows':>5}{'bound ms':>10}" + "".join(f"{be + ' ms':>13}" for be in shown))
    for model, shapes in models.items():
        for rows in row_counts:
            bound = sum(n * k * 2 * c for n, k, c in shapes) / (a.tbps * 1e9)
            sums = [sum(times[(n, k, rows, be)] * c for n, k, c in shapes) / 1e3 for be in shown]
            print(f"{model:<18}{rows:>5}{bound:>10.3f}" + "".join(f"{s:>13.3f}" for s in sums))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
