#!/usr/bin/env bash
# One GPU call, the same machine: flan-t5-large and whisper-large-v3 benches of a BASE tree
# (an older commit, unpacked under $BASE) and of this tree, interleaved so drift hits both.
#   BASE=.base bash bench/scripts/before_after.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD BASE=$(realpath "${BASE:-.base}")
export OUT=$(realpath -m "${OUT:-./gpu-out}") WORK=${WORK:-/tmp/gpu-out} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT" "$WORK"
T5="--model google/flan-t5-large --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128 --quiet --concurrency 1,64 --num-requests 8,128 --warmup 2"
WH="--model openai/whisper-large-v3 --load-format dummy --dtype bfloat16 --audio-seconds 30 --output-len 96 --quiet --concurrency 1,64 --num-requests 4,128 --warmup 1"
bench() {  # bench TREE NAME ARGS...: install TREE, run enc2dec bench from it
  local tree=$1 name=$2 t0=$SECONDS; shift 2
  (cd "$tree" && python -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install-$name.log" 2>&1)
  echo "[$tree] enc2dec bench $* --report-json $name.json" >>"$WORK/commands.txt"
  (cd "$tree" && timeout ${BENCH_LIMIT_S:-150} python -m enc2dec.cli.main bench "$@" --report-json "$WORK/$name.json" \
      >"$WORK/$name.log" 2>&1)
  echo "$name: exit $? after $((SECONDS - t0)) s"
}
bench "$BASE" t5-before $T5
bench "$REPO" t5-after $T5
bench "$BASE" whisper-before $WH
bench "$REPO" whisper-after $WH
(cd "$REPO" && python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
python - "$WORK" <<'PY'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
print(f"{'run':16} {'C':>3} {'out tok/s':>10} {'TPOT ms':>8} {'ITL p50':>8} {'ITL p99':>8}")
for name in ("t5-before", "t5-after", "whisper-before", "whisper-after"):
    p = work / f"{name}.json"
    if not p.exists():
        print(f"{name:16} missing"); continue
    for lv in json.loads(p.read_text())["levels"]:
        g = lambda k: lv.get(k) if lv.get(k) is not None else float("nan")
        print(f"{name:16} {lv['concurrency']:>3} {g('out_tok_per_s'):>10.0f} {g('mean_tpot_ms'):>8.3f} "
              f"{g('p50_itl_ms'):>8.2f} {g('p99_itl_ms'):>8.2f}")
PY
