"""Where each thread of a py-spy recording spends its samples (``py-spy record -f raw --threads``).

    python bench/scripts/spy_top.py spy.raw [--thread enc2dec-engine] [--top 25]

A lab script (bench/scripts is not installed). Prints the samples of every thread, then for
the threads whose name contains ``--thread`` (all when omitted) the functions with the most
samples, inclusive (the function or anything it called) and self (the innermost frame).
"""
from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m['func']} ({m['file'].rsplit('/', 2)[-2] if '/' in m['file'] else ''}/{m['file'].rsplit('/', 1)[-1]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("--thread", default="")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    threads: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in open(a.raw, errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[0].startswith("process ") and len(frames) > 1:     # --subprocesses: the thread follows
            frames = [f"{frames[0].split(':', 1)[0]} {frames[1]}", *frames[2:]]
        thread = frames[0]
        threads[thread] += n
        if a.thread not in thread:
            continue
        names = [_name(f) for f in frames[1:]]
        for name in set(names):
            inclusive[name] += n
        if names:
            own[names[-1]] += n
    total = sum(n for t, n in threads.items() if a.thread in t) or 1
    print(f"{'samples':>8}  thread")
    for t, n in threads.most_common(12):
        print(f"{n:>8}  {t[:110]}")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title} (share of the selected threads' {total} samples)")
        for name, n in counter.most_common(a.top):
            print(f"{100 * n / total:>6.1f}%  {name[:120]}")


if __name__ == "__main__":
    main()
