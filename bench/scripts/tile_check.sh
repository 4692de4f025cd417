#!/usr/bin/env bash
# Whether the experimental tile GEMM knobs earn their place, in one device call (about 9 minutes):
#   1. tile_gemm_bench.py --no-sweep: the tile GEMM against the separate kernels + cuBLAS at
#      flan-t5-large's decoder shapes, 16/64/256 rows (default configs only)
#   2. enc2dec bench A/B, dummy weights, bf16, NUM_REQUESTS (default 512): flan-t5-large 128/128,
#      whisper-large-v3 and whisper-large-v3-turbo 30 s/96 at C=64, bart-large-cnn 384/128 at C=128
#      (the last skipped if the budget AB_S is spent), each with the defaults (base), tuning.tile_gemm
#      on (tile) and tuning.tile_gemm_encoder on (tenc), one machine, one call (real_workloads.sh's
#      t5-ab / wh-ab / turbo-ab / bart-ab, after its warm-up run); their table (summarize.py)
#   3. the GPU tests of the tile kernel and of the head-major pool past 2**31 elements
#   4. tile_gemm_bench.py --encoder --no-sweep: Whisper's encoder GEMMs, fc1 + GELU fused
# Everything also lands in $OUT.
#
#   OUT=$OUT bash bench/scripts/tile_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=$(realpath -m "${OUT:-./gpu-out}") PYTHONUNBUFFERED=1
mkdir -p "$OUT"
WORK=${WORK:-/tmp/tile-ab}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"

timeout "${MICRO_S:-60}" python bench/scripts/tile_gemm_bench.py --no-sweep 2>&1 | tee "$OUT/tile.txt" | tail -26
NUM_REQUESTS=${NUM_REQUESTS:-512} TOTAL_S=${AB_S:-300} \
    AB="${AB:-base:ENC2DEC_TILE_GEMM=0 tile:ENC2DEC_TILE_GEMM=1 tenc:ENC2DEC_TILE_GEMM_ENCODER=1}" \
    OUT="$OUT" WORK="$WORK" bash bench/scripts/real_workloads.sh warm ${AB_SECTIONS:-t5-ab wh-ab turbo-ab bart-ab} \
    >"$OUT/real_workloads.txt" 2>&1
python bench/scripts/summarize.py "$WORK" | tee "$OUT/ab.txt"
timeout "${TESTS_S:-100}" python -m pytest -q -m gpu tests/test_kernels_gpu.py -k "tile or past_2_31" 2>&1 \
    | tee "$OUT/tests.txt" | tail -4
timeout "${ENCODER_S:-40}" python bench/scripts/tile_gemm_bench.py --encoder --no-sweep 2>&1 \
    | tee "$OUT/tile_encoder.txt" | tail -10
