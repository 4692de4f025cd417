"""How a CPU decode step's weight reads slow down when other work runs between them.

A CPU decode step at one row is a chain of GEMVs (each streams one weight matrix) separated by
small ops (norms, attention, adds). This times the GEMVs of flan-t5-small's 8 decoder layers
(the shapes of one step, 86 MB of float32 weights) back to back, and with a gap after each
GEMV: a busy-wait that touches no memory, or ``--norms`` RMS norms (the engine's kind of small
op). On a shared cloud VM the GEMVs' share grows with the gap even on one thread and with no
memory traffic in it, which points at the weights' residency in the host's shared last-level
cache decaying with time rather than at threads or the small ops' own traffic.

    python bench/scripts/cpu_gemv_gaps.py --threads 2 --gaps-us 0,30,70,140,300 --norms 0,2,5,10
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# flan-t5-small, one decoder layer at one row: fused self q/k/v, self out, cross q, cross out,
# fused gated wi_0/wi_1, wo ([out, in] each)
LAYER_SHAPES = [(1152, 512), (512, 384), (384, 512), (512, 384), (2048, 512), (512, 1024)]


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gaps-us", default="0,30,70,140,300", help="busy-wait after each GEMV, microseconds")
    ap.add_argument("--norms", default="0,2,5,10", help="RMS norms of one row after each GEMV")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers = [[torch.randn(o, i) for o, i in LAYER_SHAPES] for _ in range(args.layers)]
    xs = {i: torch.randn(1, i) for _, i in LAYER_SHAPES}
    row, weight = torch.randn(1, 512), torch.randn(512)
    nbytes = sum(w.numel() * 4 for layer in layers for w in layer)

    def measure(after) -> tuple[float, float]:
        """Median per step of (GEMV time, time in the gaps), ms; 5 warm-up steps."""
        gemv, gaps = [], []
        for step in range(args.steps + 5):
            g = s = 0.0
            for layer in layers:
                for w in layer:
                    t0 = time.perf_counter()
                    F.linear(xs[w.shape[1]], w)
                    t1 = time.perf_counter()
                    after()
                    t2 = time.perf_counter()
                    g, s = g + t1 - t0, s + t2 - t1
            if step >= 5:
                gemv.append(g)
                gaps.append(s)
        gemv.sort()
        gaps.sort()
        return gemv[len(gemv) // 2] * 1e3, gaps[len(gaps) // 2] * 1e3

    print(f"{args.threads} thread(s), {len(layers) * len(LAYER_SHAPES)} GEMVs a step, {nbytes / 1e6:.0f} MB")
    print(f"{'gap after each GEMV':>28} | {'GEMVs ms/step':>13} | {'GB/s':>5} | {'gaps ms/step':>12}")
    for us in (float(v) for v in args.gaps_us.split(",")):
        g, s = measure(lambda: _spin(us))
        print(f"{f'busy-wait {us:.0f} us':>28} | {g:13.2f} | {nbytes / g / 1e6:5.1f} | {s:12.2f}")
    for k in (int(v) for v in args.norms.split(",")):
        def norms(k=k):
            for _ in range(k):
                F.rms_norm(row, (512,), weight, 1e-6)
        g, s = measure(norms)
        print(f"{f'{k} RMS norms':>28} | {g:13.2f} | {nbytes / g / 1e6:5.1f} | {s:12.2f}")


if __name__ == "__main__":
    main()
