#!/usr/bin/env bash
# Issue 3's tables on one GPU (an H200): flan-t5-large (128 -> 128 tokens) and
# whisper-large-v3 (30 s audio -> 96 tokens), dummy weights, bf16, concurrency 1, 8, 32, 64,
# against transformers generate eager (hf) and static cache + torch.compile (hf-compile).
#
#   bench/scripts/gpu_suite.sh t5; bench/scripts/gpu_suite.sh whisper     # or all (default) in one go
#
# On an H200 t5 takes about 4 minutes and whisper 4-5 (hf-compile compiles about 35 s per
# batch size), so where one command may run at most 10 minutes, run the two models as two
# commands.
#
# Writes $OUT/<name>.json (enc2dec.bench/v1, rewritten after every level), .csv and .log,
# and $OUT/commands.txt (the exact commands), then prints a short table. Environment:
# OUT (default ./bench-out), NUM_REQUESTS (per level, default 4,16,64,128: see
# docs/bench.md for the trade-off), LIMIT_S (per model, default 420 s); for a CPU smoke run
# of the script itself: T5_MODEL, WHISPER_MODEL (config folders), DTYPE, BASELINES.
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
WHAT=${1:-all}
OUT=${OUT:-./bench-out}
NUM_REQUESTS=${NUM_REQUESTS:-4,16,64,128}
LIMIT_S=${LIMIT_S:-420}
T5_MODEL=${T5_MODEL:-google/flan-t5-large}
WHISPER_MODEL=${WHISPER_MODEL:-openai/whisper-large-v3}
mkdir -p "$OUT"

# enc2dec importable: installed, else an editable install, else a symlink shim of the
# package-dir layout (enc2dec.bench -> bench/, ...), for machines with no index.
if ! python -c "import enc2dec.bench, enc2dec.engine" 2>/dev/null; then
    pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
fi
if ! python -c "import enc2dec.bench, enc2dec.engine" 2>/dev/null; then
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/enc2dec" && touch "$SHIM/enc2dec/__init__.py"
    for d in engine kernels bench eval serve cli; do ln -s "$PWD/$d" "$SHIM/enc2dec/$d"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/machine.txt"

COMMON=(--load-format dummy --dtype "${DTYPE:-bfloat16}" --concurrency "${CONCURRENCY:-1,8,32,64}" --num-requests "$NUM_REQUESTS"
        --warmup 2 --baseline "${BASELINES:-hf,hf-compile}" --quiet)

bench() {   # bench NAME ARGS...: one model, all levels and baselines
    local name=$1; shift
    echo "enc2dec bench $* --report-json $OUT/$name.json --csv $OUT/$name.csv" | tee -a "$OUT/commands.txt"
    local t0=$SECONDS
    timeout "$LIMIT_S" python -m enc2dec.cli.main bench "$@" \
        --report-json "$OUT/$name.json" --csv "$OUT/$name.csv" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "  -> exit $rc after $((SECONDS - t0)) s (log: $OUT/$name.log)"
    [ $rc -eq 0 ] || tail -5 "$OUT/$name.log"
}

if [ "$WHAT" = t5 ] || [ "$WHAT" = all ]; then
    bench flan-t5-large --model "$T5_MODEL" "${COMMON[@]}" --input-len 128 --output-len 128
fi
if [ "$WHAT" = whisper ] || [ "$WHAT" = all ]; then
    bench whisper-large-v3 --model "$WHISPER_MODEL" "${COMMON[@]}" --audio-seconds 30 --output-len 96
fi

python - "$OUT" <<'EOF'
import glob, json, os, sys

for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rep = json.load(open(path))
    if rep.get("schema") != "enc2dec.bench/v1":
        continue
    print(f"\n{rep['model']} ({rep.get('dtype')}, {rep.get('device', {}).get('name')})"
          f"{'' if rep.get('complete') else '  [INCOMPLETE]'}")
    by = {(lv["backend"], lv["concurrency"]): lv for lv in rep["levels"]}
    cols = ["enc2dec", "hf", "hf-compile"]
    print(f"{'C':>4} " + " ".join(f"{c + ' tok/s':>18}" for c in cols)
          + f" {'x hf':>7} {'x hf-compile':>13} {'enc2dec p99 E2E ms':>19} {'failed':>7}")
    for c in rep["concurrency"]:
        row = [by.get((b, c)) for b in cols]
        tok = [f"{lv['out_tok_per_s']:>18,.0f}" if lv else f"{'-':>18}" for lv in row]
        x = [f"{row[0]['out_tok_per_s'] / lv['out_tok_per_s']:.2f}x" if row[0] and lv and lv["out_tok_per_s"]
             else "-" for lv in row[1:]]
        p99 = f"{row[0]['p99_e2e_ms']:,.0f}" if row[0] and row[0]["p99_e2e_ms"] is not None else "-"
        failed = sum(lv["failed"] for lv in row if lv)
        print(f"{c:>4} " + " ".join(tok) + f" {x[0]:>7} {x[1]:>13} {p99:>19} {failed:>7}")
EOF
