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
for f in "$OUT"/l*.json; do python - "$f" <<'PY'
import json, pathlib, sys
p = pathlib.Path(sys.argv[1])
for lv in json.loads(p.read_text())["levels"]:
    if lv["backend"] == "enc2dec":
        print(f"{p.stem:<6}{lv['out_tok_per_s']:>9,.0f} dur {lv['duration_s']:.2f} s TTFT p50/p90/p99 {lv['p50_ttft_ms']:.0f}/"
              f"{lv['p90_ttft_ms']:.0f}/{lv['p99_ttft_ms']:.0f} step {lv.get('engine_step_ms') or 0:.2f}")
PY
  ev=${f%.json}.events
  grep -E "slow-step|gc gen" "$ev" 2>/dev/null | sed -E 's/^ *([0-9.]+) [0-9]+ /    \1 /' | cut -c1-170 | tail -${TAIL:-12}
done
