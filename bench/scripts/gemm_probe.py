"""How far a decode step's multi-row products are from the weight read, per BLAS backend.

    python bench/scripts/gemm_probe.py [--rows 64,128,256] [--triton [--pdl]] [--json out.json]
    python bench/scripts/gemm_probe.py --chain [--rows 64] [--models flan-t5-large] [--configs tilecfg.json]

Issue 19's steps at C=64-256 are ~45% cuBLAS products (profile_step.py), each far below the
bandwidth its weight read would allow. For every decoder projection of flan-t5-large,
bart-large-cnn and whisper-large-v3 (TP=1, bf16) and each row count, it times ``F.linear``
under torch's cuBLAS and cuBLASLt backends, 100 graph-captured calls cycling through enough
weight copies to overflow the L2 (as a step reads every layer once), and prints microseconds a
call, the weight-read rate, and per model a step's sum over its layers against the same bytes
at the copy rate ``--tbps``. Session 33 (docs/benchmarks.md) found each product's ~4 us fixed
latency rather than bytes or tiles. ``--triton``: also the engine's tile GEMM
(``kernels/tile_gemm.py``) over ``TILE_CONFIGS``, each configuration's time and the best per
shape; ``--pdl`` launches it programmatically (its weight rows prefetched into L2 before it
waits for the kernel before it, which here is the previous product). ``--chain``: a whole step's
products as the decoder runs them, each fed by the one before (``LAYER_CHAINS``), cuBLAS
against the tile GEMM with and without programmatic launch, per step, with the outputs'
largest difference from cuBLAS's. A lab script (bench/scripts is not installed); needs a CUDA GPU.
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


# One decoder layer's products in order, for --chain: (name, N, K, activation, gated, bias);
# each takes the previous output's first K columns (a view), so the chain is dependent as a
# step's is (attention and norms left out: the products and the MLP activation only).
LAYER_CHAINS = {
    "flan-t5-large": (24, 32128, [("qkv", 3072, 1024, None, False, False), ("o", 1024, 1024, None, False, False),
                                  ("cross q", 1024, 1024, None, False, False), ("cross o", 1024, 1024, None, False, False),
                                  ("gate|up", 5632, 1024, "gelu_tanh", True, False),
                                  ("down", 1024, 2816, None, False, False)]),
    "bart-large-cnn": (12, 50264, [("qkv", 3072, 1024, None, False, True), ("o", 1024, 1024, None, False, True),
                                   ("cross q", 1024, 1024, None, False, True), ("cross o", 1024, 1024, None, False, True),
                                   ("fc1", 4096, 1024, "gelu", False, True), ("fc2", 1024, 4096, None, False, True)]),
    "whisper-large-v3": (32, 51866, [("qkv", 3840, 1280, None, False, True), ("o", 1280, 1280, None, False, True),
                                     ("cross q", 1280, 1280, None, False, True),
                                     ("cross o", 1280, 1280, None, False, True),
                                     ("fc1", 5120, 1280, "gelu", False, True), ("fc2", 1280, 5120, None, False, True)]),
}

# 128-row tiles (8 warps) for 65-128 rows: one row tile reads each weight once, where two 64-row
# ones read it twice (session 37's sweep had only 64-row tiles, and lost to cuBLAS at 128 rows).
# Split-K (the sixth element): wider feature tiles, K in 2-8 pieces, so a 64-row product keeps
# the SMs busy with each program reading a fraction of the rows' activations.
TILE_CONFIGS = [(64, bn, bk, 4, st, 1) for bn in (16, 32, 64) for bk in (64, 128, 256) for st in (2, 3, 4)] + \
    [(128, bn, bk, 8, st, 1) for bn in (16, 32, 64) for bk in (64, 128) for st in (2, 3)] + \
    [(64, bn, bk, 4, 3, sk) for bn in (32, 64, 128) for bk in (64, 128) for sk in (2, 4, 8)]


def _step_time(run, launches: int = 5) -> float:
    """Microseconds a replay of ``run()`` captured in one CUDA graph."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / launches


def chain(models, row_counts, tbps, configs: str = "") -> list[dict]:
    """A decode step's products (every layer, then the head) in one graph, per variant: cuBLAS with
    the activation as its own (Triton) kernel, as the engine runs today; the Triton tile GEMM
    with the activation fused; each with and without programmatic launch."""
    from enc2dec.kernels import gated_gelu, gelu, set_programmatic_launch
    from enc2dec.kernels.tile_gemm import set_configs_file, tile_linear

    def cublas(x, w, b, act, gated):
        y = F.linear(x, w, b)
        if act is None:
            return y
        return gated_gelu(y, approximate="tanh" if act == "gelu_tanh" else "none") if gated else \
            gelu(y, approximate="tanh" if act == "gelu_tanh" else "none")

    def tile(x, w, b, act, gated):
        return tile_linear(x, w, b, act=act, gated=gated)

    # name: (product, programmatic launch, configurations file)
    variants = {"cublas": (cublas, False, ""), "cublas+pdl": (cublas, True, ""), "tile": (tile, False, ""),
                "tile+pdl": (tile, True, "")}
    if configs:        # the engine's tile GEMM with a --save-configs file (split K where it chose it)
        variants["tile+pdl+cfg"] = (tile, True, configs)
    results = []
    for model in models:
        layers, vocab, products = LAYER_CHAINS[model]
        d = products[0][2]
        weights = [[(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
                     torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None, act, gated)
                    for _, n, k, act, gated, bias in products] for _ in range(layers)]
        head = torch.randn(vocab, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5
        nbytes = sum(w.numel() * 2 for layer in weights for w, *_ in layer) + head.numel() * 2
        for rows in row_counts:
            x0 = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "rows": rows, "bound_us": nbytes / (tbps * 1e6)}
            outs = {}
            for name, (fn, pdl, cfg) in variants.items():
                set_programmatic_launch(pdl)
                set_configs_file(cfg)

                def run(fn=fn):
                    h = x0
                    for layer in weights:
                        for w, b, act, gated in layer:
                            h = fn(h[:, :w.shape[1]], w, b, act, gated)
                    outs[name] = F.linear(h[:, :d], head)
                try:
                    row[name] = _step_time(run)
                except Exception as e:  # noqa: BLE001 - a variant the driver refuses is reported, not fatal
                    row[name] = float("nan")
                    print(f"{model} rows={rows} {name}: {type(e).__name__}: {e}", flush=True)
            set_programmatic_launch(False)
            set_configs_file("")
            ref = outs["cublas"].float()
            row["max_rel_err"] = {k: ((v.float() - ref).abs().max() / ref.abs().max()).item() for k, v in outs.items()}
            results.append(row)
            print(f"{model:<18} rows={rows:>4}  bound {row['bound_us'] / 1e3:6.3f} ms  " + "  ".join(
                f"{k} {row[k] / 1e3:6.3f} ms" for k in variants) + f"  (tile+pdl / cublas {row['cublas'] / row['tile+pdl']:.2f}x)",
                flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--tbps", type=float, default=4.3, help="the copy rate to compare with (H200: 4.3)")
    ap.add_argument("--models", default=",".join(MODELS), help="a comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--triton", action="store_true", help="also time the engine's tile GEMM (kernels/tile_gemm.py) "
                    "over TILE_CONFIGS, with programmatic launch as --pdl says")
    ap.add_argument("--pdl", action="store_true", help="launch the Triton kernels programmatically")
    ap.add_argument("--chain", action="store_true", help="only the step chains: every layer's products in one graph, "
                    "cuBLAS against the tile GEMM, each with and without programmatic launch")
    ap.add_argument("--json")
    ap.add_argument("--configs", metavar="PATH", help="with --chain: also the tile GEMM with this --save-configs "
                    "file's configurations (tile+pdl+cfg)")
    ap.add_argument("--save-configs", metavar="PATH", help="with --triton: write each shape's best configuration, "
                    "its best unsplit one and whether it beat cuBLAS, the file ENC2DEC_TILE_GEMM_CONFIGS reads")
    a = ap.parse_args()
    if a.chain:
        results = chain(a.models.split(","), [int(r) for r in a.rows.split(",")], a.tbps, a.configs or "")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    import triton

    from enc2dec.kernels import set_programmatic_launch
    from enc2dec.kernels.tile_gemm import tile_linear

    set_programmatic_launch(a.pdl)
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
                for config in TILE_CONFIGS:
                    if k % config[2] or config[0] > max(64, rows):
                        continue
                    fn = (lambda config: lambda x, w: tile_linear(x, w, config=config))(config)
                    try:
                        err = (fn(x, weights[0]).float() - ref).abs().max().item()
                    except triton.runtime.errors.OutOfResources:       # over the shared memory
                        continue
                    if err > 0.05 * ref.abs().max().item():
                        raise AssertionError(f"tile {config} off by {err} on {n}x{k}")
                    tiles[",".join(map(str, config))] = _time(fn, weights, x)
                best = min(tiles, key=tiles.get)
                unsplit = min((c for c in tiles if c.endswith(",1")), key=tiles.get)
                row["tiles"], row["tile_best"], row["tile_best_unsplit"] = tiles, best, unsplit
                row["triton"] = times[(n, k, rows, "triton")] = tiles[best]
            results.append(row)
            if a.save_configs and a.triton:        # as it goes: a sweep stopped at its limit keeps what it found
                save_configs(results, a.save_configs)
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
    if a.save_configs and a.triton:
        print(f"configurations of {save_configs(results, a.save_configs)} shapes in {a.save_configs}")


def save_configs(results: list[dict], path: str) -> int:
    """The swept shapes' best tile configurations as ENC2DEC_TILE_GEMM_CONFIGS reads them."""
    configs = {f"{r['rows']},{r['n']},{r['k']}": {
        "config": [int(v) for v in r["tile_best"].split(",")],
        "unsplit": [int(v) for v in r["tile_best_unsplit"].split(",")],
        "pays": r["triton"] < r["cublas"]} for r in results if "tile_best" in r}
    with open(path, "w") as f:
        json.dump(configs, f, indent=1)
    return len(configs)


if __name__ == "__main__":
    main()
