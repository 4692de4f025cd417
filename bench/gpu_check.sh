#!/usr/bin/env bash
# One call on a GPU machine: install, the GPU test suite, then a quick enc2dec bench.
#   bench/gpu_check.sh            (OUT defaults to ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install failed"; tail -5 "$OUT/install.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/machine.txt"
timeout ${TEST_LIMIT_S:-240} python -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
for spec in "google/flan-t5-large --input-len 128 --output-len 128" \
            "openai/whisper-large-v3 --audio-seconds 30 --output-len 96"; do
  timeout ${BENCH_LIMIT_S:-150} enc2dec bench --model $spec --load-format dummy --dtype bfloat16 \
      --concurrency 1,8,64 --num-requests 8,32,128 --warmup 2 --quiet 2>&1 | tail -12
done
