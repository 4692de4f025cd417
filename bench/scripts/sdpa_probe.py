"""Host and GPU time of one encoder attention call per SDPA backend, at the shapes of an
eager (not graph-replayed) encoder batch: what a step that encodes beside decoding pays on the
host for each of its layers' attention calls.

    python bench/scripts/sdpa_probe.py                                  # bart-large-cnn, 384 positions
    python bench/scripts/sdpa_probe.py --batches 5,2 --length 1500 --heads 20

For each batch size and backend: the first call's host time (a cuDNN graph is built per shape),
then the mean host time of a call issued behind ~20 ms of queued GPU work (so the figure is the
host's own; a backend that synchronises with the device shows that queue spread over the calls),
and the mean GPU time of a call. A lab
script (bench/scripts is not installed); the engine's figures come from `enc2dec bench`.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="21,16,5,1", help="sequences per call, a comma list")
    ap.add_argument("--length", type=int, default=384, help="positions per sequence")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: SDPA over [batch, {a.heads}, {a.length}, {a.head_dim}] bf16, "
          f"q/k/v transposed views of [batch, {a.length}, {a.heads}, {a.head_dim}] (the engine's layout)")
    print(f"{'batch':>5} {'backend':>9} {'first call ms':>14} {'host us a call':>15} {'GPU us a call':>14}")
    queue = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for b in map(int, a.batches.split(",")):
        q, k, v = (torch.randn(b, a.length, a.heads, a.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))

        def call():
            F.scaled_dot_product_attention(q, k, v, scale=a.head_dim ** -0.5)
        for name, backend in BACKENDS.items():
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                try:
                    t0 = time.perf_counter()
                    call()
                    first = time.perf_counter() - t0
                except RuntimeError as e:          # a backend that does not take these shapes
                    print(f"{b:>5} {name:>9} not available: {str(e).splitlines()[0][:60]}")
                    continue
                torch.cuda.synchronize()
                for _ in range(20):                # ~20 ms of GPU work ahead of the timed calls
                    queue @ queue
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    call()
                host = (time.perf_counter() - t0) / a.calls
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(a.calls):
                    call()
                end.record()
                torch.cuda.synchronize()
                print(f"{b:>5} {name:>9} {first * 1e3:>14.2f} {host * 1e6:>15.1f} "
                      f"{start.elapsed_time(end) * 1e3 / a.calls:>14.1f}")


if __name__ == "__main__":
    main()
