#!/usr/bin/env bash
# Catch a mid-run stall in the act (docs/benchmarks.md, session 25): bench lines run RUNS times
# each under bench/scripts/jit_log (Triton compiles, graph captures, GC passes over 10 ms, engine
# steps over STALL_MS with the stack of a step still running), then the slow events of every run.
#   OUT=$OUT RUNS=3 bash bench/scripts/stall_hunt.sh "enc2dec bench ARGS..." [...]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/bench/scripts/jit_log${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export STALL_MS=${STALL_MS:-150}
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
i=0
for line in "$@"; do
  i=$((i + 1))
  for k in $(seq "${RUNS:-3}"); do
    name=l$i-$k t0=$SECONDS
    JIT_LOG=$OUT/$name.events timeout ${LIMIT_S:-150} ${line/enc2dec /python -m enc2dec.cli.main } \
        --report-json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s"
  done
done
python bench/scripts/summarize.py "$OUT"
for ev in "$OUT"/l*.events; do
  echo "${ev##*/}: slow steps and long collections"
  grep -E "slow-step|gc gen" "$ev" 2>/dev/null | sed -E 's/^ *([0-9.]+) [0-9]+ /    \1 /' | cut -c1-170 | tail -${TAIL:-12}
done
