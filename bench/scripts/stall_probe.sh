#!/usr/bin/env bash
# Mid-run stalls (docs/benchmarks.md, session 25): whisper-large-v3-turbo C=64 twice on a fresh
# machine (cold, then warm Triton cache), the first under py-spy, every Triton compile and CUDA
# graph capture logged with its time (bench/scripts/jit_log); then whisper-large-v3 plain and
# --timestamps with the same log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/bench/scripts/jit_log${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="python -m enc2dec.cli.main bench --load-format dummy --dtype bfloat16 --quiet --warmup 1 --max-batch-size 64 --concurrency 64 --audio-seconds 30 --output-len 96"
one() {  # one NAME ARGS...
  local name=$1; shift
  local t0=$SECONDS
  JIT_LOG=$OUT/jit-$name.log timeout ${LIMIT_S:-120} "$@" --report-json "$OUT/$name.json" >"$OUT/$name.out" 2>&1 &
  local pid=$!
  # py-spy beside the first run (if carried and allowed): where the process spends a stall
  [ "$name" = turbo1 ] && command -v py-spy >/dev/null && \
      { py-spy record -r 50 -f raw -s -o "$OUT/turbo1.spy" --pid "$pid" >"$OUT/spy.log" 2>&1 & }
  wait "$pid"
  echo "$name: exit $? after $((SECONDS - t0)) s; compiles $(grep -c compile-end "$OUT/jit-$name.log" 2>/dev/null) captures $(grep -c graph-capture "$OUT/jit-$name.log" 2>/dev/null)"
}
one turbo1 $B --model openai/whisper-large-v3-turbo --num-requests ${NUM:-512}
one turbo2 $B --model openai/whisper-large-v3-turbo --num-requests ${NUM:-512}
[ -n "${TURBO_ONLY:-}" ] || {
  one wh-plain $B --model openai/whisper-large-v3 --num-requests ${NUM:-512}
  one wh-ts $B --model openai/whisper-large-v3 --num-requests ${NUM:-512} --timestamps
}
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys, pathlib
p = pathlib.Path(sys.argv[1]); d = json.loads(p.read_text())
for lv in d["levels"]:
    print(f"{p.stem:<10}{lv['backend']:<9}{lv['out_tok_per_s']:>9,.0f} dur {lv['duration_s']:.2f} s  TTFT p50/p90/p99 "
          f"{lv['p50_ttft_ms']:.0f}/{lv['p90_ttft_ms']:.0f}/{lv['p99_ttft_ms']:.0f}  step {lv.get('engine_step_ms') or 0:.2f}")
PY
done
