"""Print a short table from the JSON reports in a folder (used by gpu_check.sh, ab_patch.sh and
stall_hunt.sh): out tok/s, TPOT, TTFT mean and p50 / p90 / p99 (a one-off stall shows in the tail),
ITL p50 / p99 (issue 19's rule: p99 at most 3x p50), p99 E2E, failures, and the engine's step ms /
decoder rows / share of the step spent waiting for the GPU where the report has them.

    python bench/scripts/summarize.py REPORT_FOLDER
"""
import glob
import json
import os
import sys


def main(out: str) -> None:
    print(f"{'report':<16}{'backend':<12}{'C':>4}{'out tok/s':>12}{'TPOT ms':>9}{'TTFT ms':>10}{'p50/p90/p99':>16}"
          f"{'ITL p50/p99':>13}{'p99 E2E ms':>12}{'fail':>6}{'step ms/rows/wait':>20}")
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        try:
            with open(path) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            continue
        name = os.path.basename(path)[:-5] + ("" if rep.get("complete") else "*")
        for lv in rep.get("levels", []):
            f = lambda k: f"{lv[k]:,.1f}" if lv.get(k) is not None else "-"   # noqa: E731
            tail = "/".join(f"{lv[k]:.0f}" if lv.get(k) is not None else "-"
                            for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"))
            itl = "/".join(f"{lv[k]:.1f}" if lv.get(k) is not None else "-" for k in ("p50_itl_ms", "p99_itl_ms"))
            step = "-" if not lv.get("engine_steps") else (
                f"{lv['engine_step_ms']:.2f}/{lv['engine_rows_per_step']:.1f}/{lv.get('engine_device_wait_frac') or 0:.0%}")
            print(f"{name:<16}{lv['backend']:<12}{lv['concurrency']:>4}{lv['out_tok_per_s']:>12,.0f}"
                  f"{f('mean_tpot_ms'):>9}{f('mean_ttft_ms'):>10}{tail:>16}{itl:>13}{f('p99_e2e_ms'):>12}{lv['failed']:>6}{step:>20}")
    print("(* = incomplete: the run hit its time limit; finished levels are kept)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
