#!/usr/bin/env bash
# Whisper parity and speedup against transformers on one GPU: enc2dec eval in bfloat16 (the
# speed claim) and in float32 (the exactness claim), on an audio manifest repeated REPEAT times
# so the timed runs hold enough requests to batch. Reports land under OUT; a summary prints last.
#
#   bench/scripts/gpu_eval.sh WHISPER_FOLDER MANIFEST_JSONL
#   OUT=./eval-out REPEAT=16 BATCH_SIZE=32 bench/scripts/gpu_eval.sh ~/whisper-base ~/speech/manifest.jsonl
#   DEVICE=cpu REPEAT=1 BATCH_SIZE=2 bench/scripts/gpu_eval.sh ...     (a smoke test without a GPU)
#
# WHISPER_FOLDER is a Hugging Face folder (config.json, weights, tokenizer, preprocessor_config.json);
# MANIFEST_JSONL holds {"audio": file, "text": reference} lines, files relative to it. The metrics
# need jiwer; on a machine without network, set WHEELS to a folder of wheels made elsewhere with
# `pip download jiwer -d wheels` and the script installs from it.
# Exit code: 0 when both runs finished (figures are recorded, not judged), 2 for bad arguments.
set -uo pipefail
if [ $# -lt 2 ] || [ ! -f "$1/config.json" ] || [ ! -f "$2" ]; then
  echo "usage: $0 WHISPER_FOLDER MANIFEST_JSONL   (a checkpoint folder with config.json, a manifest file)" >&2
  exit 2
fi
MODEL=$(realpath "$1"); MANIFEST=$(realpath "$2")
cd "$(dirname "$0")/../.."   # the repository root
OUT=$(realpath -m "${OUT:-./eval-out}"); mkdir -p "$OUT"
REPEAT=${REPEAT:-16}; BATCH_SIZE=${BATCH_SIZE:-32}; LIMIT_S=${LIMIT_S:-280}; DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if ! python -c "import jiwer" 2>/dev/null; then
  if [ -n "${WHEELS:-}" ]; then
    python -m pip install -q --no-index --find-links "$WHEELS" jiwer || exit 2
  else
    echo "jiwer is not installed (WER/CER need it): pip install jiwer, or set WHEELS=folder of wheels" >&2
    exit 2
  fi
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null
} | tee "$OUT/machine.txt"

# The manifest REPEAT times over, audio paths made absolute.
python - "$MANIFEST" "$REPEAT" "$OUT/manifest.jsonl" <<'PY'
import json, os, sys
src, repeat, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
base = os.path.dirname(src)
rows = [json.loads(line) for line in open(src, encoding="utf-8") if line.strip()]
with open(dst, "w", encoding="utf-8") as f:
    for _ in range(repeat):
        for r in rows:
            if isinstance(r.get("audio"), str) and not os.path.isabs(r["audio"]):
                r = {**r, "audio": os.path.join(base, r["audio"])}
            f.write(json.dumps(r) + "\n")
print(f"{len(rows)} rows x {repeat} = {len(rows) * repeat} requests")
PY

run() {  # run NAME DTYPE
  local name=$1 dtype=$2
  local cmd=(python -m enc2dec.cli.main eval --task transcription --model "$MODEL" --data "$OUT/manifest.jsonl"
             --dtype "$dtype" --device "$DEVICE" --batch-size "$BATCH_SIZE" --warmup "$BATCH_SIZE" --quiet
             --report-json "$OUT/$name.json" --save-outputs "$OUT/$name.rows.jsonl")
  echo "${cmd[*]}" >>"$OUT/commands.txt"
  timeout "$LIMIT_S" "${cmd[@]}" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc"
  [ $rc -eq 2 ] && tail -3 "$OUT/$name.log"
  return 0
}
run bf16 bfloat16
run fp32 float32

python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':<6} {'rows':>5} {'parity':>8} {'text':>7} {'1st diff':>10} {'WER ours':>9} {'WER hf':>8} "
      f"{'ours s':>8} {'hf s':>8} {'speedup':>8}")
for name in ("bf16", "fp32"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(f"{name:<6} no report (see {name}.log)")
        continue
    r = json.load(open(path))
    p, t, m = r["parity"], r["timing"], r["metrics"]
    diff = "-" if p["first_diff_min"] is None else f"{p['first_diff_mean']:.1f}/{p['first_diff_min']}"
    print(f"{name:<6} {p['num_compared']:>5} {p['exact_match']:>8.3f} {p['text_exact_match']:>7.3f} {diff:>10} "
          f"{m['enc2dec']['wer']:>9.4f} {m['hf']['wer']:>8.4f} {t['enc2dec_s']:>8.2f} {t['hf_s']:>8.2f} "
          f"{t['speedup']:>7.2f}x")
print(f"reports: {out}/bf16.json, {out}/fp32.json (commands in {out}/commands.txt)")
PY
