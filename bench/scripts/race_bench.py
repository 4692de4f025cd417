"""Time the filtered sampling race per row (1 split) against the split race.

    python bench/scripts/race_bench.py [--splits 2,4,8,16] [--launches 20] [--repeats 15]
    python bench/scripts/race_bench.py --compile-check     # no GPU needed: builds every variant for sm_90

For 64 x 32,128 (flan-t5 at C=64) and 256 x 51,866 (whisper-large-v3 at C=256) it draws
temperature-0.8 logits with top-p 0.95 on every row (the sampled benchmark's settings) and
times ``filtered_race`` with 1 split, ``race_splits``' choice and each ``--splits`` value,
each as ``--launches`` calls captured in one CUDA graph (as the decoder step replays them),
median over ``--repeats`` replays. Also times the unfiltered ``gumbel_race`` as the floor.
Prints microseconds per call and whether each variant's tokens equal the per-row kernel's.
"""
from __future__ import annotations

import argparse
import statistics

import torch

SHAPES = [(64, 32128), (256, 51866)]


def _case(rows: int, vocab: int, seed: int = 0):
    from enc2dec.engine.runner.sampling_ops import stream_key

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(rows, vocab, device="cuda", generator=g) * 3 / 0.8
    floor = torch.full((rows,), float("-inf"), device="cuda")
    top_p = torch.full((rows,), 0.95, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    keys = torch.tensor([[*stream_key(seed + r, 0), r] for r in range(rows)], device="cuda")
    return scores, floor, top_p, min_p, keys


def _time_us(fn, launches: int, repeats: int) -> float:
    """Microseconds per call of ``fn()`` over ``launches`` graph-captured calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()                                   # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(times)


def bench(split_choices: list[int], launches: int, repeats: int) -> None:
    from enc2dec.kernels import sampling

    print(f"{'rows x vocab':>14} {'kernel':>16} {'us/call':>9} {'vs 1 split':>10} {'same tokens':>11}")
    for rows, vocab in SHAPES:
        scores, floor, top_p, min_p, keys = _case(rows, vocab)
        auto = sampling.race_splits(rows, vocab, device=scores.device)
        per_row = sampling.filtered_race(scores, floor, top_p, min_p, keys, splits=1)
        plain = _time_us(lambda: sampling.gumbel_race(scores, keys), launches, repeats)
        print(f"{rows:>5} x {vocab:<6} {'plain race':>16} {plain:9.1f}")
        base = None
        for splits in dict.fromkeys([1, auto, *split_choices]):
            us = _time_us(lambda s=splits: sampling.filtered_race(scores, floor, top_p, min_p, keys, splits=s),
                          launches, repeats)
            base = base or us
            same = torch.equal(sampling.filtered_race(scores, floor, top_p, min_p, keys, splits=splits), per_row)
            name = f"{splits} split{'s' if splits > 1 else ''}" + (" (auto)" if splits == auto else "")
            print(f"{rows:>5} x {vocab:<6} {name:>16} {us:9.1f} {base / us:9.2f}x {str(same):>11}")


def compile_check(split_choices: list[int]) -> None:
    """Build every kernel variant that ``filtered_race`` launches for sm_90, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from enc2dec.kernels import sampling

    target = GPUTarget("cuda", 90, 32)

    def arg_type(name: str, scores_type: str) -> str:
        if name == "scores_ptr":
            return scores_type
        if name in ("seeded_ptr", "fresh_ptr", "out_ptr"):
            return "*i64"
        if name in ("part_i", "prev_i", "state_in_i", "state_i"):
            return "*i32"
        if name.endswith("_ptr") or name in ("part_f", "prev_f", "state_in_f", "state_f"):
            return "*fp32"
        return "i32"                           # vocab, chunk, row counts and strides

    def build(kernel, constexprs: dict, scores_type: str) -> None:
        kernel[(1,)]                           # lazy_jit: jit the kernel and its helpers, launch nothing
        fn = kernel._kernel
        signature = {n: "constexpr" if n in constexprs else arg_type(n, scores_type) for n in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target,
                       options={"num_warps": sampling.NUM_WARPS})
        print(f"ok {fn.__name__} {scores_type} {constexprs}", flush=True)

    block = sampling.BLOCK
    splits_seen = sorted({sampling.race_splits(r, v) for r in (1, 8, 32, 64, 128, 256) for v in (32128, 51866)}
                         | set(split_choices))
    for scores_type in ("*fp32", "*bf16"):
        build(sampling._filtered_race_kernel, {"BLOCK": block}, scores_type)
        for splits in (s for s in splits_seen if s > 1):
            meta = {"SPLITS": splits, "SPLITS_P2": 1 << (splits - 1).bit_length(), "BLOCK": block}
            build(sampling._split_max_kernel, {"SPLITS": splits, "BLOCK": block}, scores_type)
            build(sampling._split_floor_kernel, meta, scores_type)
            for after_floor in (True, False):
                build(sampling._split_round_kernel, {"AFTER_FLOOR": after_floor, **meta}, scores_type)
                build(sampling._split_finish_kernel, {"AFTER_FLOOR": after_floor, **meta}, scores_type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="2,4,8,16", help="split counts to time besides 1 and the auto choice")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile-check", action="store_true", help="compile for sm_90 only (no GPU needed)")
    args = parser.parse_args()
    split_choices = [int(s) for s in args.splits.split(",") if s]
    if args.compile_check:
        compile_check(split_choices)
    else:
        bench(split_choices, args.launches, args.repeats)


if __name__ == "__main__":
    main()
