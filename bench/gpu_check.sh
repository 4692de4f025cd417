#!/usr/bin/env bash
# One call on a GPU machine: install, the GPU test suite, issue 3's tables (bench/gpu_suite.sh),
# and a graphs-off ablation. Every part has its own time limit; reports land under $OUT.
#   OUT=./gpu-out bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
echo "== pytest -m gpu"
timeout ${TEST_LIMIT_S:-100} python -m pytest -m gpu -q -p no:cacheprovider tests/ >"$OUT/gpu_tests.log" 2>&1
echo "exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -12
echo "== issue 3 suite"
LIMIT_S=${SUITE_LIMIT_S:-190} NUM_REQUESTS=${NUM_REQUESTS:-4,16,64} CONCURRENCY=${CONCURRENCY:-1,8,64} bash bench/gpu_suite.sh all 2>&1 | tail -30
echo "== ablation: decoder CUDA graphs off"
printf 'cuda_graph_config: null\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' > "$OUT/nographs.yaml"
timeout ${ABL_LIMIT_S:-60} python -m enc2dec.cli.main bench --model google/flan-t5-large --load-format dummy --dtype bfloat16 \
   --config "$OUT/nographs.yaml" --concurrency 1,64 --num-requests 4,64 --warmup 1 --input-len 128 --output-len 128 \
   --quiet --report-json "$OUT/ablation-nographs.json" 2>&1 | tail -8
