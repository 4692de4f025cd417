#!/usr/bin/env bash
# One call on a GPU machine, in sections: install, then any of
#   tests    pytest -m gpu (engine GPU tests first, then kernels)
#   profile  bench/scripts/profile_step.py: kernels per decoder step, T5 and Whisper, C=1 and 64
#   t5       flan-t5-large 128/128 at T5_CONC against BASELINES (issue 4's targets)
#   ablate   graphs off / overlap off / torch attention / skinny GEMV off / its fused norms off /
#            encoder graphs off, at C=1 and 64 (T5_ABLATE; Whisper for those in WHISPER_ABLATE);
#            'default' is the same levels with nothing off, e.g. WHISPER_ABLATE="default noegraph"
#   whisper  whisper-large-v3 30 s/96 tokens at WHISPER_CONC against BASELINES
#   wtok     whisper-large-v3 at C=64 for each per-step token budget in WTOK (admission speed)
#   rtf      bench/scripts/transcribe_rtf.sh (10 minutes of audio, both long-form strategies)
#   eval     enc2dec eval on the real LibriVox manifest with real Whisper base, bf16, vs HF
#   beam     bench/scripts/beam_check.sh (if present);  tp  bench/scripts/tp_check.sh (if present)
# Each part has its own time limit. Reports land in $WORK (default /tmp/gpu-out) and are packed
# into $OUT/results.tgz (the device returns a few files only); a short table is printed last.
#
#   OUT=./gpu-out bench/scripts/gpu_check.sh tests profile whisper rtf
#
# Real Whisper folders packed by bench/scripts/carry_real.py are unpacked from .carry*/ into /tmp/real;
# wheels in .whl/ (soundfile, soxr, jiwer, ...) are installed into /tmp/site. A transfer limit
# of 64 MiB per call means the pieces travel over consecutive calls on a warm machine, e.g.
#   python bench/scripts/carry_real.py pack ~/.cache/enc2dec-real whisper-tiny.en /tmp/tiny --piece-mb 52
#   python bench/scripts/carry_real.py pack ~/.cache/enc2dec-real whisper-base /tmp/base --piece-mb 30
# then spread the parts (and speech/) over .carry1 ... .carry4, one folder carried per call.
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
REPO=$PWD
export OUT=$(realpath -m "${OUT:-./gpu-out}"); mkdir -p "$OUT"
export WORK=${WORK:-/tmp/gpu-out}; mkdir -p "$WORK"
SECTIONS=${*:-tests t5 ablate whisper}
# The commit measured: $COMMIT when the caller passes it (the device's copy of .git can lag the
# working tree it receives), else HEAD here, marked "+dirty" when the tree differs from it.
if [ -n "${COMMIT:-}" ]; then echo "$COMMIT" ; else
  echo "$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)"; fi | tee "$WORK/commit.txt"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$REPO"/.whl/*.whl && touch /tmp/site/.done
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 || tail -3 "$WORK/install.log"
# Carried pieces do not survive between calls inside the repo: keep them under /tmp/carry.
if ls -d "$REPO"/.carry* >/dev/null 2>&1; then
  mkdir -p /tmp/carry && cp -r "$REPO"/.carry*/. /tmp/carry/
fi
if [ -d /tmp/carry ]; then
  python bench/scripts/carry_real.py unpack /tmp/carry /tmp/real 2>&1 | tail -4
  [ -d /tmp/carry/speech ] && [ ! -f /tmp/real/speech/manifest.jsonl ] && mkdir -p /tmp/real && cp -r /tmp/carry/speech /tmp/real/
  export ENC2DEC_REAL_MODELS=/tmp/real
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} | tee "$WORK/machine.txt"
B="python -m enc2dec.cli.main bench"
BASELINES=${BASELINES:-hf,hf-compile}
T5="--model google/flan-t5-large --load-format dummy --dtype bfloat16 --input-len 128 --output-len 128 --quiet"
WH="--model openai/whisper-large-v3 --load-format dummy --dtype bfloat16 --audio-seconds 30 --output-len 96 --quiet"
run() {  # run NAME LIMIT ARGS...
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "enc2dec bench $* --report-json $name.json" >>"$WORK/commands.txt"
  timeout "$limit" $B "$@" --report-json "$WORK/$name.json" >"$WORK/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s"
}
for section in $SECTIONS; do
  echo "== $section ($(date -u +%H:%M:%S))"
  case $section in
  tests)
    timeout ${TEST_LIMIT_S:-240} python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py \
        tests/test_kernels_gpu.py tests/test_kernels.py tests/test_encoder_graphs.py $(ls tests/test_*gpu*.py | grep -v -e test_gpu_engine -e test_kernels_gpu -e test_tp_gpu) \
        >"$WORK/gpu_tests.log" 2>&1
    echo "exit $?"; grep -E "passed|failed" "$WORK/gpu_tests.log" | tail -1
    grep -E "^FAILED|^ERROR" "$WORK/gpu_tests.log" | head -8 ;;
  profile)
    for args in "google/flan-t5-large 1" "google/flan-t5-large 64" "openai/whisper-large-v3 1" "openai/whisper-large-v3 64"; do
      set -- $args
      timeout ${PROFILE_LIMIT_S:-75} python bench/scripts/profile_step.py --model $1 --concurrency $2 --output-len 48 --top 18 \
          --json "$WORK/profile-${1#*/}-c$2.json" 2>&1 | grep -v -e Warning -e warn -e "^ *self.profiler" | tail -22
    done ;;
  t5) run t5 ${T5_LIMIT_S:-300} $T5 --concurrency ${T5_CONC:-1,8,64} --num-requests ${T5_NUM:-8,32,128} --warmup 2 \
        --baseline "$BASELINES" ;;
  ablate)   # T5_ABLATE / WHISPER_ABLATE name the variants (default: all for T5, none for Whisper)
    printf 'cuda_graph_config: null\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$WORK/nographs.yaml"
    printf 'disable_overlap_scheduler: true\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$WORK/nooverlap.yaml"
    printf 'attn_backend: torch\ncuda_graph_config: null\nkv_cache_config:\n  cross_kv_cache_fraction: 0.5\n' >"$WORK/torchattn.yaml"
    printf 'encoder_cuda_graph_config: null\n' >"$WORK/noegraph.yaml"
    variant() {  # variant MODEL NAME: one ablation run at C=1 and 64
      local args=$1 name=$2; shift 2
      case ${name#*-} in
        noskinny) ENC2DEC_SKINNY_GEMM=0 run "$name" ${ABLATE_LIMIT_S:-45} $args "$@" ;;
        nofuse) ENC2DEC_FUSED_GEMV=0 run "$name" ${ABLATE_LIMIT_S:-45} $args "$@" ;;
        default) run "$name" ${ABLATE_LIMIT_S:-45} $args "$@" ;;       # the same levels, nothing off
        *) run "$name" ${ABLATE_LIMIT_S:-45} $args --config "$WORK/${name#*-}.yaml" "$@" ;;
      esac
    }
    for v in ${T5_ABLATE-nographs nooverlap torchattn noskinny nofuse noegraph}; do
      variant "$T5" "t5-$v" --concurrency 1,64 --num-requests 4,64 --warmup 1
    done
    for v in ${WHISPER_ABLATE:-}; do
      variant "$WH" "whisper-$v" --concurrency 1,64 --num-requests 4,64 --warmup 1
    done ;;
  whisper) run whisper ${WHISPER_LIMIT_S:-300} $WH --concurrency ${WHISPER_CONC:-1,8,32,64} \
        --num-requests ${WHISPER_NUM:-4,16,64,128} --warmup 1 --baseline "$BASELINES" ;;
  wtok) for t in ${WTOK:-8192 24576}; do
      run "whisper-mnt$t" ${WTOK_LIMIT_S:-100} $WH --concurrency 64 --num-requests 128 --warmup 1 --max-num-tokens $t
    done ;;
  rtf) OUT=$WORK RUN_LIMIT_S=${RTF_LIMIT_S:-100} timeout ${RTF_TOTAL_S:-400} bash bench/scripts/transcribe_rtf.sh 2>&1 | tail -7 ;;
  eval)
    if [ -d /tmp/real/whisper-base ] && [ -d /tmp/real/speech ]; then
      echo "enc2dec eval --task transcription --model /tmp/real/whisper-base --data /tmp/real/speech/manifest.jsonl --dtype bfloat16 --warmup 2 --report-json eval-base-bf16.json" >>"$WORK/commands.txt"
      timeout ${EVAL_LIMIT_S:-150} python -m enc2dec.cli.main eval --task transcription --model /tmp/real/whisper-base \
          --data /tmp/real/speech/manifest.jsonl --dtype bfloat16 --warmup 2 --report-json "$WORK/eval-base-bf16.json" \
          >"$WORK/eval-base-bf16.log" 2>&1; echo "eval: exit $?"; tail -14 "$WORK/eval-base-bf16.log"
    else echo "eval: real whisper-base not here"; fi ;;
  beam) [ -f bench/scripts/beam_check.sh ] && OUT=$WORK timeout ${BEAM_LIMIT_S:-240} bash bench/scripts/beam_check.sh 2>&1 | tail -12 ;;
  tp) [ -f bench/scripts/tp_check.sh ] && OUT=$WORK timeout ${TP_LIMIT_S:-300} bash bench/scripts/tp_check.sh 2>&1 | tail -16 ;;
  *) echo "unknown section $section" ;;
  esac
done
tar -czf "$OUT/results.tgz" --exclude=./audio -C "$WORK" . 2>/dev/null
python bench/scripts/summarize.py "$WORK"
