"""The tile GEMM (kernels/tile_gemm.py) against the separate kernels it would replace, at
flan-t5-large's decoder shapes and a decode step's rows, on CUDA.

    python bench/scripts/tile_gemm_bench.py                       # rows 16,64,256, a small sweep
    python bench/scripts/tile_gemm_bench.py --rows 64 --full      # every config of the grid
    python bench/scripts/tile_gemm_bench.py --encoder              # Whisper's encoder GEMMs, fc1 + GELU fused
    python bench/scripts/tile_gemm_bench.py --no-sweep             # the default configs only (seconds)

For each projection of a T5 decoder layer that carries a fusion (q|k|v: add + RMSNorm before, the
K/V store after; cross q: add + RMSNorm; gate|up: add + RMSNorm, gelu_tanh(gate) * up) and the
plain ones (o, cross o, the MLP's down projection), microseconds a call of:
  separate  the engine's kernels today: fused_add_rms_norm, F.linear (cuBLAS), then store_kv or
            gated_gelu, one launch each
  tile      tile_linear with the fusions, the default config and the best of the sweep
``--encoder``: whisper-large-v3(-turbo)'s encoder projections at one and two clips (1,500 and
3,000 rows): fc1 with its bias and erf-GELU in the epilogue against cuBLAS + the GELU kernel (the
GELU is 6.7% of a clip's encoder, Run T1), and q|k|v and fc2 plain, which show how far the
Triton GEMM is from cuBLAS where there is nothing to fuse.
Each timing replays ``--iters`` calls in one CUDA graph (launch cost excluded, gaps between kernels
included), cycling over ``--copies`` weight copies so the weights come from HBM, not L2, as in
a decode step. The last table sums one decoder layer. A diagnosis tool: the engine's figures
come from ``enc2dec bench``.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from enc2dec.kernels.activations import gated_gelu, gelu
from enc2dec.kernels.kv_store import store_kv
from enc2dec.kernels.norms import fused_add_rms_norm
from enc2dec.kernels.skinny_gemm import Prologue
from enc2dec.kernels.tile_gemm import launch_config, tile_linear

D, FF, HEADS, HEAD_DIM, TPB = 1024, 2816, 16, 64, 16
# name: (output features, input features, fusion, bias)
SHAPES = {"qkv": (3 * D, D, "norm+store", False), "cross_q": (D, D, "norm", False),
          "gate_up": (FF, D, "norm+gated", False), "o": (D, D, None, False), "cross_o": (D, D, None, False),
          "down": (D, FF, None, False)}
ENC_D, ENC_FF = 1280, 5120           # whisper-large-v3's encoder
ENCODER_SHAPES = {"enc_qkv": (3 * ENC_D, ENC_D, None, True), "enc_fc1": (ENC_FF, ENC_D, "gelu", True),
                  "enc_fc2": (ENC_D, ENC_FF, None, True)}


def time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / iters)
    return best


def case(name: str, rows: int, copies: int, gen):
    n, k, fusion, has_bias = {**SHAPES, **ENCODER_SHAPES}[name]
    width = 2 * n if fusion == "norm+gated" else n
    ws = [(torch.randn(width, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    bias = torch.randn(width, device="cuda", generator=gen).to(torch.bfloat16) if has_bias else None
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    gain = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    caches = [torch.zeros(4 * rows // TPB + 4, TPB, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    slots = torch.randperm(caches[0].shape[0] * TPB, device="cuda", generator=gen)[:rows]
    res_out = torch.empty_like(res)

    def separate(i):
        w = ws[i % copies]
        a = fused_add_rms_norm(x, res, gain, 1e-6)[0] if fusion and fusion.startswith("norm") else x
        y = F.linear(a, w, bias)
        if fusion == "norm+store":
            _, kk, vv = y.view(rows, 3, HEADS, HEAD_DIM).unbind(1)
            store_kv(kk, vv, caches[0], caches[1], slots)
        elif fusion == "norm+gated":
            y = gated_gelu(y)
        elif fusion == "gelu":
            y = gelu(y)
        return y

    def tile(config):
        def run(i):
            w = ws[i % copies]
            a = Prologue(x, residual=res, norm_weight=gain, eps=1e-6, res_out=res_out) \
                if fusion and fusion.startswith("norm") else x
            act = {"norm+gated": "gelu_tanh", "gelu": "gelu"}.get(fusion)
            return tile_linear(a, w, bias, act=act,
                               gated=fusion == "norm+gated",
                               kv_store=(caches[0], caches[1], slots) if fusion == "norm+store" else None,
                               config=config)
        return run
    return separate, tile, (n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="comma-separated rows (decode-step sequences; default 16,64,256, "
                    "with --encoder 1500,3000)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {','.join(SHAPES)} (the default), or with "
                    f"--encoder of {','.join(ENCODER_SHAPES)}")
    ap.add_argument("--encoder", action="store_true", help="whisper-large-v3's encoder GEMMs instead")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--copies", type=int, default=12, help="weight copies cycled (past the L2 cache)")
    ap.add_argument("--full", action="store_true", help="sweep the whole config grid (slower)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="time the default config only (a sweep compiles 24-48 configs per shape and rows)")
    a = ap.parse_args()
    a.rows = a.rows or ("1500,3000" if a.encoder else "16,64,256")
    a.shapes = a.shapes or ",".join(ENCODER_SHAPES if a.encoder else SHAPES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: flan-t5-large decoder projections, bf16, us a call")
    print(f"{'shape':<9}{'rows':>5}{'separate':>10}{'tile dflt':>10}{'tile best':>10}  {'best (BM,BN,BK,warps,stages)':<30}{'sep/best':>9}")
    layer: dict[int, list[float]] = {}
    for rows in map(int, a.rows.split(",")):
        for name in a.shapes.split(","):
            separate, tile, (n, k) = case(name, rows, a.copies, gen)
            sep = time_us(separate, a.iters)
            default = launch_config(rows, n, k)
            dflt = time_us(tile(default), a.iters)
            bms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, rows)]
            if a.no_sweep:
                grid = ()
            elif a.encoder:
                grid = itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))
            elif a.full:
                grid = itertools.product(bms, (16, 32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
            else:
                grid = itertools.product(bms[-2:], (16, 32, 64), (64, 128), (4,), (3, 4))
            best, best_cfg = dflt, default
            for cfg in grid:
                try:
                    us = time_us(tile(cfg), a.iters)
                except Exception as e:   # noqa: BLE001 - a config the compiler refuses (shared memory)
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                if us < best:
                    best, best_cfg = us, cfg
            print(f"{name:<9}{rows:>5}{sep:>10.1f}{dflt:>10.1f}{best:>10.1f}  {str(best_cfg):<30}{sep / best:>8.2f}x")
            sums = layer.setdefault(rows, [0.0, 0.0, 0.0])
            for j, v in enumerate((sep, dflt, best)):
                sums[j] += v
    print(f"\none {'encoder' if a.encoder else 'decoder'} layer ({', '.join(a.shapes.split(','))}), us")
    for rows, (sep, dflt, best) in layer.items():
        print(f"rows {rows:>4}: separate {sep:7.1f}  tile default {dflt:7.1f}  tile best {best:7.1f}  "
              f"({sep / best:.2f}x; x{32 if a.encoder else 24} layers: "
              f"{(32 if a.encoder else 24) * (sep - best):+.0f} us a {'launch' if a.encoder else 'step'})")


if __name__ == "__main__":
    main()
