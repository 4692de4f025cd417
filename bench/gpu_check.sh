#!/usr/bin/env bash
# One call on a GPU machine: install, the GPU test suite, enc2dec bench for flan-t5-large,
# the ablations (CUDA graphs, overlap, attention backend), and the whisper-large-v3 suite
# against transformers. Each part has its own time limit; JSON reports land under $OUT and a
# short table is printed last.      OUT=./gpu-out bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=$(realpath -m "${OUT:-./gpu-out}"); mkdir -p "$OUT"
# Run the committed tree only (work in progress beside it stays out of the measurement).
if git rev-parse --verify -q HEAD >/dev/null; then
  git rev-parse --short HEAD | tee "$OUT/commit.txt"
  rm -rf /tmp/enc2dec-src && mkdir -p /tmp/enc2dec-src && git archive HEAD | tar -x -C /tmp/enc2dec-src
  cd /tmp/enc2dec-src
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} | tee "$OUT/machine.txt"
B="python -m enc2dec.cli.main bench"
T5="--model google/flan-t5-large --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128 --quiet"
run() {  # run NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  echo "enc2dec bench $* --report-json $OUT/$name.json" >>"$OUT/commands.txt"
  timeout "$limit" $B "$@" --report-json "$OUT/$name.json" >"$OUT/$name.log" 2>&1; echo "$name: exit $?"
}
echo "== pytest -m gpu"
timeout ${TEST_LIMIT_S:-60} python -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py tests/test_gpu_engine.py tests/test_bench.py >"$OUT/gpu_tests.log" 2>&1
echo "exit $?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -8
echo "== flan-t5-large"
run t5 60 $T5 --concurrency 1,8,32,64 --num-requests 8,32,64,128 --warmup 2
printf 'cuda_graph_config: null\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$OUT/nographs.yaml"
printf 'disable_overlap_scheduler: true\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$OUT/nooverlap.yaml"
printf 'attn_backend: torch\ncuda_graph_config: null\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$OUT/torchattn.yaml"
for v in nographs nooverlap torchattn; do
  run "t5-$v" 35 $T5 --config "$OUT/$v.yaml" --concurrency 1,64 --num-requests 4,64 --warmup 1
done
echo "== whisper-large-v3"
run whisper ${WHISPER_LIMIT_S:-170} --model openai/whisper-large-v3 --load-format dummy --dtype bfloat16 \
    --audio-seconds 30 --output-len 96 --concurrency 1,8,64 --num-requests 4,16,64 --warmup 1 \
    --baseline hf,hf-compile --quiet
python bench/summarize.py "$OUT"
