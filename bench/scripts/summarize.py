"""Print a short table from the JSON reports in a folder (used by bench/scripts/gpu_check.sh).

    python bench/scripts/summarize.py REPORT_FOLDER
"""
import glob
import json
import os
import sys


def main(out: str) -> None:
    print(f"{'report':<16}{'backend':<12}{'C':>4}{'out tok/s':>12}{'TPOT ms':>9}{'TTFT ms':>10}{'p99 E2E ms':>12}"
          f"{'fail':>6}")
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        try:
            with open(path) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            continue
        name = os.path.basename(path)[:-5] + ("" if rep.get("complete") else "*")
        for lv in rep.get("levels", []):
            f = lambda k: f"{lv[k]:,.1f}" if lv.get(k) is not None else "-"   # noqa: E731
            print(f"{name:<16}{lv['backend']:<12}{lv['concurrency']:>4}{lv['out_tok_per_s']:>12,.0f}"
                  f"{f('mean_tpot_ms'):>9}{f('mean_ttft_ms'):>10}{f('p99_e2e_ms'):>12}{lv['failed']:>6}")
    print("(* = incomplete: the run hit its time limit; finished levels are kept)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
