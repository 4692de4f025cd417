#!/usr/bin/env bash
# Diagnosis runs for issue 17's small-model targets on one H200, a section per argument:
#   t5base   flan-t5-base C=256: the step timeline of one 256-request wave, bench without a
#            baseline (under py-spy: where the engine thread's time goes) and with 1024 requests
#   turbo    whisper-large-v3-turbo C=64: bench at encoder budgets / join steps (TURBO_VARIANTS,
#            "tokens:join" pairs; 0 = the default) and the step timeline of the first and the last
#
#   OUT=./gpu-out bash bench/scripts/gpu_diag.sh t5base turbo
#
# Serve's and py-spy's wheels travel in .whl/ (carry it); reports, logs and py-spy files are packed
# into $OUT/gpu_diag.tgz, a short table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=$(realpath -m "${OUT:-./gpu-out}") WORK=${WORK:-/tmp/diag} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT" "$WORK"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.done
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="python -m enc2dec.cli.main bench --load-format dummy --dtype bfloat16 --quiet --warmup 1"
T5="$B --model google/flan-t5-base --max-batch-size 256 --input-len 128 --output-len 128 --concurrency 256"
TURBO="$B --model openai/whisper-large-v3-turbo --max-batch-size 64 --audio-seconds 30 --output-len 96 --concurrency 64"
run() {  # run NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  echo "${RUN_ENV:-} $* --report-json $name.json" >>"$WORK/commands.txt"
  env ${RUN_ENV:-} timeout "$limit" "$@" --report-json "$WORK/$name.json" >"$WORK/$name.log" 2>&1
  echo "$name: exit $?"
}
for section in "$@"; do
  case $section in
  t5base)
    timeout 90 python bench/scripts/step_timeline.py --model google/flan-t5-base --concurrency 256 \
        --num-requests 256 --first 8 2>&1 | grep -v Warn >"$WORK/tl-t5base-256.txt"
    tail -9 "$WORK/tl-t5base-256.txt"
    RUN_ENV="" run t5b-spy 90 /tmp/site/bin/py-spy record --threads -r 400 -f raw -o "$WORK/t5b-spy.raw" -- $T5 --num-requests 256
    python bench/scripts/spy_top.py "$WORK/t5b-spy.raw" --thread enc2dec-engine --top 30 >"$WORK/t5b-spy.txt" 2>&1
    head -50 "$WORK/t5b-spy.txt"
    run t5b-1024 90 $T5 --num-requests 1024 ;;
  turbo)
    for v in ${TURBO_VARIANTS:-0:0 3000:2 3000:3 6000:3}; do
      tok=${v%:*} join=${v#*:}
      RUN_ENV="$( [ "$tok" != 0 ] && echo ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=$tok) $( [ "$join" != 0 ] && echo ENC2DEC_ENCODER_JOIN_STEPS=$join)" \
          run "turbo-$tok-$join" 90 $TURBO --num-requests 256
    done ;;
  *) echo "unknown section $section"; exit 2 ;;
  esac
done
tar -czf "$OUT/gpu_diag.tgz" -C "$WORK" .
python - "$WORK" <<'PY'
import json, pathlib, sys
print(f"\n{'run':<16}{'out tok/s':>11}{'TPOT':>7}{'TTFT':>7}{'ITL p50/p99':>13}{'step ms/rows/wait':>20}")
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for lv in json.loads(p.read_text())["levels"]:
        step = "-" if not lv.get("engine_steps") else \
            f"{lv['engine_step_ms']:.2f}/{lv['engine_rows_per_step']:.1f}/{lv['engine_device_wait_frac']:.0%}"
        print(f"{p.stem:<16}{lv['out_tok_per_s']:>11,.0f}{lv['mean_tpot_ms']:>7.2f}{lv['mean_ttft_ms']:>7.0f}"
              f"{lv['p50_itl_ms']:>6.1f}/{lv['p99_itl_ms']:<6.1f}{step:>20}")
PY
