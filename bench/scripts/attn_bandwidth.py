"""How fast the paged decode kernel reads cross K/V: token-major against head-major pools.

    python bench/scripts/attn_bandwidth.py                          # whisper-large-v3/turbo, C=64
    python bench/scripts/attn_bandwidth.py --rows 8,64 --kv-dtype fp8 --splits auto,1,2,4
    python bench/scripts/attn_bandwidth.py --configs default,16:1,32:1,64:2,64:4,128:4

One decode step's cross-attention of one layer: ``rows`` queries (one per request), each over its
own ``keys`` positions (a Whisper clip: 1,500) of ``heads`` x ``head_dim``, in a pool laid out as
the engine lays it out (every clip's blocks one run, clips at shuffled places in a pool about
twice the size the step reads). Each (layout, split count) is timed over ``--iters`` launches
replayed in a CUDA graph, after a warm-up (``--configs``: the kernel's keys per tile and warps
per program, ``launch_config``'s choice by default, for a sweep); the table gives microseconds a call and the K/V read
rate (bytes of K and V the call must read, scales included, per second). A diagnosis tool for
``tuning.cross_kv_head_major``; the engine's figures come from ``enc2dec bench``.
"""
from __future__ import annotations

import argparse

import torch

from enc2dec.kernels import paged_attention as kernel
from enc2dec.kernels.paged_attention import paged_attention, pick_num_splits


def _pool(num_blocks: int, tpb: int, heads: int, head_dim: int, dtype, head_major: bool, gen) -> torch.Tensor:
    shape = (heads, num_blocks, tpb, head_dim) if head_major else (num_blocks, tpb, heads, head_dim)
    t = (torch.randn(shape, generator=gen, device="cuda") * 0.5).to(dtype)
    return t.permute(1, 2, 0, 3) if head_major else t


def _case(rows: int, keys: int, heads: int, head_dim: int, tpb: int, fp8: bool, head_major: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_clip = -(-keys // tpb)
    slots = 2 * rows                                     # a pool twice what the step reads
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:rows]
    tables = (order[:, None] * per_clip + torch.arange(per_clip)[None, :]).to(torch.int32).cuda()
    num_blocks = slots * per_clip
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k, v = (_pool(num_blocks, tpb, heads, head_dim, dtype, head_major, gen) for _ in range(2))
    scales = None
    if fp8:     # the scales laid out as their values are (KVCache.allocate)
        shape = (heads, num_blocks, tpb) if head_major else (num_blocks, tpb, heads)
        scales = tuple(torch.rand(shape, generator=gen, device="cuda").to(torch.float16) * 0.01 for _ in range(2))
        if head_major:
            scales = tuple(s.permute(1, 2, 0) for s in scales)
    q = torch.randn((rows, heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((rows,), keys, dtype=torch.int32, device="cuda")
    return q, k, v, qsl, lens, tables, scales


def _time(fn, iters: int) -> float:
    """Microseconds a call, ``iters`` calls replayed in one CUDA graph (launch cost excluded)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64", help="comma-separated decoder rows (requests) per step")
    ap.add_argument("--keys", type=int, default=1500, help="cross positions per request")
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bf16,fp8", help="comma-separated: bf16, fp8")
    ap.add_argument("--splits", default="auto", help="comma-separated split counts, or auto (the engine's pick)")
    ap.add_argument("--configs", default="default",
                    help="comma-separated BLOCK_N:num_warps of the kernel, or default (launch_config's)")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: cross-attention of one layer, {a.keys} keys x {a.heads} heads x "
          f"{a.head_dim}, blocks of {a.tokens_per_block}")
    print(f"{'rows':>5} {'kv':>5} {'splits':>7} {'tile':>6} {'layout':>11} {'us/call':>9} {'GB read':>8} {'TB/s':>6} "
          f"{'vs first':>9}")
    default_config = kernel.launch_config
    for rows in map(int, a.rows.split(",")):
        for kv_dtype in a.kv_dtype.split(","):
            fp8 = kv_dtype == "fp8"
            base = None                  # the first row of this (rows, kv dtype): the engine's choice
            for split_arg, config in ((s, c) for s in a.splits.split(",") for c in a.configs.split(",")):
                if config == "default":
                    kernel.launch_config = default_config
                    tile = "auto"
                else:
                    block_n, warps = map(int, config.split(":"))
                    kernel.launch_config = lambda block_d, element_bytes=2, n=block_n, w=warps: (n, w, 2)
                    tile = config
                for head_major in (False, True):
                    q, k, v, qsl, lens, tables, scales = _case(rows, a.keys, a.heads, a.head_dim,
                                                               a.tokens_per_block, fp8, head_major, seed=rows)
                    splits = pick_num_splits(rows, a.heads, a.keys, q.device) if split_arg == "auto" else int(split_arg)
                    out = torch.empty_like(q)

                    def call():
                        paged_attention(q, k, v, qsl, lens, tables, a.head_dim ** -0.5, causal=False, out=out,
                                        num_splits=splits, kv_scales=scales)
                    us = _time(call, a.iters)
                    nbytes = 2 * rows * a.keys * a.heads * (a.head_dim * k.element_size() + (2 if fp8 else 0))
                    base = base or us
                    print(f"{rows:>5} {kv_dtype:>5} {splits:>7} {tile:>6} {'head-major' if head_major else 'token-major':>11} "
                          f"{us:>9.1f} {nbytes / 1e9:>8.3f} {nbytes / us / 1e6:>6.2f} {base / us:>8.2f}x")


if __name__ == "__main__":
    main()
