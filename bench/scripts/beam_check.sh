#!/usr/bin/env bash
# Beam search on one GPU (issue #8's figure): dummy flan-t5-large in bf16, 128 input / 128
# output tokens, concurrency 8. Three rows: enc2dec greedy, enc2dec beam width 4, and
# transformers generate(num_beams=4) (plain hf by default; BEAM_BASELINE=hf-compile tries the
# compiled static-cache one, falling back to hf when it fails). JSON reports land under $OUT; a small table is printed last.
# About 4 minutes at most (gpu_check.sh's "beam" section runs it with a 240 s limit).
#     OUT=./gpu-out bench/scripts/beam_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
export OUT=$(realpath -m "${OUT:-./gpu-out}"); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python -c "import enc2dec.cli.main" 2>/dev/null ||
  python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/beam-machine.txt"
B="python -m enc2dec.cli.main bench"
W="--model google/flan-t5-large --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128
   --concurrency 8 --num-requests 16 --warmup 1 --quiet"
run() {  # run NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  echo "enc2dec bench $* --report-json $OUT/$name.json" >>"$OUT/commands.txt"
  timeout "$limit" $B "$@" --report-json "$OUT/$name.json" >"$OUT/$name.log" 2>&1; echo "$name: exit $?"
}
run beam-greedy 50 $W
BASE=${BEAM_BASELINE:-hf}     # hf-compile compiles once per batch shape: minutes more
run beam-w4 125 $W --beam-width 4 --baseline "$BASE"
if [ "$BASE" = hf-compile ] && ! python -c "import json,sys; d=json.load(open('$OUT/beam-w4.json')); sys.exit(0 if any(l['backend']=='hf-compile' and l['completed'] for l in d['levels']) else 1)" 2>/dev/null; then
  run beam-w4-hf 60 $W --beam-width 4 --baseline hf
fi
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for name, label in (("beam-greedy", "enc2dec greedy"), ("beam-w4", "enc2dec beam 4"), ("beam-w4-hf", None)):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        continue
    for lv in json.load(open(path))["levels"]:
        who = label if lv["backend"] == "enc2dec" else \
            f"transformers {lv['backend']} num_beams={4 if 'w4' in name else 1}"
        if who is None or (lv["backend"] == "enc2dec" and label is None):
            continue
        rows.append((who, lv["concurrency"], lv.get("completed"), lv.get("out_tok_per_s"), lv.get("mean_tpot_ms"),
                     lv.get("p99_e2e_ms"), lv.get("kv_self_blocks_peak")))
print(f"{'backend':36} {'C':>3} {'ok':>4} {'out tok/s':>10} {'TPOT ms':>8} {'p99 e2e ms':>11} {'self blk':>9}")
for who, c, ok, tps, tpot, p99, blocks in rows:
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
    print(f"{who:36} {c:>3} {ok!s:>4} {f(tps):>10} {f(tpot, 2):>8} {f(p99, 0):>11} {blocks if blocks is not None else '-':>9}")
json.dump(rows, open(os.path.join(out, "beam_summary.json"), "w"), indent=1)
PY
