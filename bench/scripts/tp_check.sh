#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (H200 x2): the TP GPU tests (float32 TP=2 greedy ids
# identical to TP=1 on tiny models; bf16 TP=2 inside CUDA graphs), then flan-t5-xl bf16 with
# dummy weights, 128 input / 128 output tokens, concurrency 1 and 64, TP=1 against TP=2.
# JSON reports land under $OUT; a short table is printed last. About 6 minutes with the
# install; each part has its own limit (TEST_LIMIT_S, BENCH_LIMIT_S); TP_TEST_K picks tests (pytest -k).
#     OUT=./tp-out bench/scripts/tp_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
export OUT=$(realpath -m "${OUT:-./tp-out}"); mkdir -p "$OUT"
# NVLink multicast off for us and the worker processes (the engine sets it too).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
python -c "import enc2dec.cli.main" 2>/dev/null ||
  python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
python -c "import torch; print('gpus', torch.cuda.device_count())" | tee "$OUT/tp-machine.txt"
echo "== pytest -m gpu tests/test_tp_gpu.py"
timeout ${TEST_LIMIT_S:-180} python -m pytest -m gpu -q -p no:cacheprovider tests/test_tp_gpu.py ${TP_TEST_K:+-k "$TP_TEST_K"} \
    >"$OUT/tp_tests.log" 2>&1
echo "exit $?"; grep -E "passed|failed|skipped" "$OUT/tp_tests.log" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/tp_tests.log" | head -8
B="python -m enc2dec.cli.main bench"
XL="--model google/flan-t5-xl --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128 --quiet"
for tp in ${TP_SIZES-1 2}; do          # TP_SIZES= (empty) runs the tests alone
  echo "enc2dec bench $XL --concurrency 1,64 --num-requests 4,64 --warmup 1 --tp-size $tp --report-json $OUT/xl-tp$tp.json" >>"$OUT/commands.txt"
  timeout ${BENCH_LIMIT_S:-150} $B $XL --concurrency 1,64 --num-requests 4,64 --warmup 1 --tp-size $tp \
      --report-json "$OUT/xl-tp$tp.json" >"$OUT/xl-tp$tp.log" 2>&1
  echo "flan-t5-xl TP=$tp: exit $?"; grep -E "^error|FAILED" "$OUT/xl-tp$tp.log" | head -3
done
python - "$OUT" <<'PY'
import json, os, sys

out = sys.argv[1]
rows = {}
for tp in (1, 2):
    try:
        rep = json.load(open(os.path.join(out, f"xl-tp{tp}.json")))
    except (OSError, ValueError):
        continue
    for lv in rep.get("levels", []):
        if lv["backend"] == "enc2dec":
            rows[(tp, lv["concurrency"])] = lv
print("\nflan-t5-xl bf16, dummy weights, 128 in / 128 out tokens")
print(f"{'TP':>4}{'C':>5}{'TPOT ms':>10}{'out tok/s':>11}{'vs TP=1':>9}{'fail':>6}")
if not rows:
    print("  no reports (see the xl-tp*.log files)")
for (tp, c), lv in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    base = rows.get((1, c))
    ratio = f"{lv['out_tok_per_s'] / base['out_tok_per_s']:.2f}x" if base and base["out_tok_per_s"] else "-"
    tpot = f"{lv['mean_tpot_ms']:.2f}" if lv.get("mean_tpot_ms") is not None else "-"
    print(f"{tp:>4}{c:>5}{tpot:>10}{lv['out_tok_per_s']:>11,.0f}{ratio:>9}{lv['failed']:>6}")
PY
