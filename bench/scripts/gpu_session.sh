#!/usr/bin/env bash
# One device session's runs, in calls of at most 10 minutes each; a short table last.
#
#   bash bench/scripts/gpu_session.sh stage 1          # carry .m1: part 1 of the real whisper-base (bf16)
#   bash bench/scripts/gpu_session.sh stage 2          # carry .m2 (the next call, straight after)
#   bash bench/scripts/gpu_session.sh stage 3 fp8acc   # carry .m3 .speech .whl: assemble, FP8-KV accuracy
#   bash bench/scripts/gpu_session.sh tests            # pytest -m gpu
#   bash bench/scripts/gpu_session.sh enginetests      # its engine-level files only (TESTS_S, default 240 s)
#   bash bench/scripts/gpu_session.sh carry longform openai/whisper-large-v3-turbo
#                                       # carry .carryN (parts of carry_real.py pack, speech/, whl/):
#                                       # longform_rtf.py on 8 ten-minute files; /tmp/real/whisper-base
#                                       # once every part has come: WER of both peers
#
# Issue 18's remaining GPU rows in four back-to-back calls (a machine idle for 30 s goes back bare):
#   pack: carry_real.py pack ~/.cache/enc2dec-real whisper-base /tmp/basepk --piece-mb 37, one part
#   (and the .count) in each of .carry1-4; .carry1/whl: soundfile, cffi, pycparser, jiwer, rapidfuzz
#   and .carry1/speech; .carry2/whl: silero-vad (each call's carry stays under 64 MiB with the tree)
#   A (.carry1):        carry tests                                          ~300 s
#   B (.carry2):        carry longform openai/whisper-large-v3               ~500 s (LONGFORM_S=560)
#   C (.carry3 .whl):   carry, then the serve/in-process runs of the call
#   D (.carry4):        carry longform /tmp/real/whisper-base                real weights: WER of both
#   On a fresh machine B alone needs the speech and wheels of .carry1/.carry2 without the model
#   parts: .carryB (speech/ and both whl/ sets, 17 MB) with .whl, `carry longform openai/whisper-large-v3`.
#   bash bench/scripts/gpu_session.sh profile          # greedy vs sampled step, flan-t5-large C=64
#   bash bench/scripts/gpu_session.sh apiside          # serve_overhead.py (CPU side of serve, idle cores)
#   bash bench/scripts/gpu_session.sh serveprof        # carry .whl .prof: py-spy over serve + 4 bench clients
#   bash bench/scripts/gpu_session.sh seeded           # flan-t5-large seeded x3, Triton compiles per run
#   bash bench/scripts/gpu_session.sh tile             # the tile GEMM: tests, configuration sweep, A/B (~9 min)
#   bash bench/scripts/gpu_session.sh tileab           # the tile GEMM on or off: t5, whisper, bart C=128 (~5 min)
#   bash bench/scripts/gpu_session.sh budget           # bart-large-cnn's encoder bound per decoding row (~5 min)
#   bash bench/scripts/gpu_session.sh decide           # tileab and the per-row bound (t5, bart C=64) in one call (~9 min)
#
# Why the parts: a call carries at most 64 MiB and whisper-base in bf16 is 147 MB, so it is
# staged in /tmp over three calls made back to back (a machine that went idle comes back bare:
# `assemble` checks the md5 and says so). The parts are a tar of the HF folder saved in bf16
# (bench/scripts/carry_real.py's job for the fp32 folders; see docs/benchmarks.md).
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT" /tmp/stage
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WB16_MD5=${WB16_MD5:-592a9d595bd1d92ca7764acc3650ec6f}

setup() {
  if ls "$REPO"/.whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ]; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$REPO"/.whl/*.whl && touch /tmp/site/.done
  fi
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || tail -3 /tmp/install.log
}

while [ $# -gt 0 ]; do
  case $1 in
  stage)
    cp "$REPO"/.m$2/part* /tmp/stage/ && echo "staged part $2: $(ls /tmp/stage | tr '\n' ' ')"
    shift ;;
  fp8acc)
    setup
    if [ ! -d /tmp/wb16/whisper-base ]; then
      cat /tmp/stage/part* > /tmp/wb16.tar
      if [ "$(md5sum /tmp/wb16.tar | cut -d' ' -f1)" != "$WB16_MD5" ]; then
        echo "fp8acc: the staged parts do not make the checkpoint (machine came back bare?): $(ls /tmp/stage)"
        shift; continue
      fi
      mkdir -p /tmp/wb16 && tar xf /tmp/wb16.tar -C /tmp/wb16
    fi
    echo "python bench/scripts/fp8_kv_accuracy.py --model /tmp/wb16/whisper-base --speech-dir .speech" >>"$OUT/commands.txt"
    timeout 400 python bench/scripts/fp8_kv_accuracy.py --model /tmp/wb16/whisper-base --speech-dir .speech \
        --report-json "$OUT/fp8_kv_accuracy.json" 2>&1 | tail -25 | tee "$OUT/fp8_kv_accuracy.txt" ;;
  carry)       # .carry*/ (carry_real.py parts, speech/, whl/): kept in /tmp/carry across warm calls
    mkdir -p /tmp/carry && cp -r "$REPO"/.carry*/. /tmp/carry/ 2>/dev/null
    ls /tmp/carry/whl/*.whl >/dev/null 2>&1 && python -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site /tmp/carry/whl/*.whl
    python bench/scripts/carry_real.py unpack /tmp/carry /tmp/real 2>&1 | tail -2
    [ -d /tmp/carry/speech ] && mkdir -p /tmp/real && cp -r /tmp/carry/speech /tmp/real/ ;;
  longform)    # longform_rtf.py on 8 ten-minute files: $2 a known name (random weights) or a folder
    setup
    name=$(basename "$2")
    echo "python bench/scripts/longform_rtf.py --speech-dir /tmp/real/speech --model $2 --files 8" >>"$OUT/commands.txt"
    nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/longform-$name.txt"
    timeout ${LONGFORM_S:-560} python bench/scripts/longform_rtf.py --speech-dir /tmp/real/speech --model "$2" --files 8 \
        2>&1 | grep -v -i "warn\|max_new_tokens" | tee -a "$OUT/longform-$name.txt" | tail -6
    shift ;;
  enginetests) # the engine-level GPU tests only (graphs, staging, overlap, no-sync steps; ~1/3 of the suite),
               # to share a call with a benchmark when starting a machine is the scarce part
    setup
    files="tests/test_gpu_engine.py tests/test_sampler_gpu.py tests/test_encoder_graphs.py tests/test_encoder_beside.py tests/test_engine_process.py"
    echo "python -m pytest -m gpu -q $files" >>"$OUT/commands.txt"
    timeout ${TESTS_S:-240} python -m pytest -m gpu -q -p no:cacheprovider $files >"$OUT/pytest_gpu_engine.txt" 2>&1
    echo "pytest -m gpu (engine): exit $?"; tail -8 "$OUT/pytest_gpu_engine.txt" ;;
  tests)
    setup
    echo "python -m pytest -m gpu -q tests/" >>"$OUT/commands.txt"
    timeout 540 python -m pytest -m gpu -q -p no:cacheprovider tests/ >"$OUT/pytest_gpu.txt" 2>&1
    echo "pytest -m gpu: exit $?"; tail -15 "$OUT/pytest_gpu.txt" ;;
  profile)     # flan-t5-large C=64: the greedy and the sampled step, GPU busy vs wall, then the host side
    setup
    for mode in "" "--temperature 0.8 --top-p 0.95"; do
      for what in "" "--cpu-profile"; do
        echo "python bench/scripts/profile_step.py --concurrency 64 --output-len 128 $mode $what" >>"$OUT/commands.txt"
        echo "== profile_step $mode $what" | tee -a "$OUT/profile.txt"
        timeout 120 python bench/scripts/profile_step.py --concurrency 64 --output-len 128 $mode $what 2>&1 \
            | grep -v Warning | head -45 >>"$OUT/profile.txt"
      done
    done
    grep -E "^==|per step|wall|busy" "$OUT/profile.txt" | head -30 ;;
  apiside)
    setup
    for L in 32 128 512; do
      echo "python bench/scripts/serve_overhead.py --output-len $L --num-requests $((32768 / L))" >>"$OUT/commands.txt"
      timeout 150 python bench/scripts/serve_overhead.py --output-len $L --num-requests $((32768 / L)) \
          --port $((8300 + L)) 2>/dev/null | tail -4 | tee -a "$OUT/serve_overhead.txt"
    done ;;
  serveprof)   # where serve's processes spend their time at C=64 (py-spy is the parent: no ptrace rights needed)
    setup
    python -m pip install -q --no-index --no-deps --target /tmp/spy "$REPO"/.prof/*.whl >/dev/null 2>&1
    API_PROCS=${API_PROCS:-1}
    echo "py-spy record --subprocesses -- enc2dec serve google/flan-t5-large ... --api-processes $API_PROCS" >>"$OUT/commands.txt"
    # SPY_FLAGS=--gil: only the thread holding each process's GIL is sampled (who holds it, how long)
    # No -d shorter than the whole run: py-spy ends its child when the duration is up, and a fresh
    # machine's start-up under py-spy took over 55 s. The recording ends when serve exits (pkill below).
    /tmp/spy/bin/py-spy record --subprocesses --nonblocking ${SPY_FLAGS:-} -r 97 -d ${SPY_S:-600} -f raw -o "$OUT/serve_spy.raw" -- \
        python -m enc2dec.cli.main serve google/flan-t5-large --load-format dummy --dtype bfloat16 --max-batch-size 64 \
        --host 127.0.0.1 --port 8777 --log-level warning $( [ "$API_PROCS" -gt 1 ] && echo --api-processes $API_PROCS ) \
        >"$OUT/serve_spy.log" 2>&1 &
    spy=$!
    for i in $(seq 150); do
      [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8777/health)" = 200 ] && break; sleep 1; done
    echo "serve healthy after ~$i s"
    clients=()
    for k in 1 2 3 4; do
      timeout 120 python -m enc2dec.cli.main bench --url http://127.0.0.1:8777 --model google/flan-t5-large --streaming \
          --quiet --warmup 1 --input-len 128 --output-len 128 --concurrency 16 --num-requests ${SPY_REQ:-512} \
          --report-json "$OUT/spy-client-$k.json" >"$OUT/spy-client-$k.log" 2>&1 &
      clients+=($!)
    done
    wait "${clients[@]}"
    pkill -INT -f "enc2dec.cli.main serve" ; wait $spy
    python - "$OUT" <<'PY'
import json, pathlib, sys
tot = 0
for p in sorted(pathlib.Path(sys.argv[1]).glob("spy-client-*.json")):
    lv = json.loads(p.read_text())["levels"][0]; tot += lv["out_tok_per_s"]
    print(p.stem, round(lv["out_tok_per_s"]), "TPOT", round(lv["mean_tpot_ms"], 2), "failed", lv["failed"])
print("summed out tok/s", round(tot))
PY
    tar -czf "$OUT/serveprof.tgz" -C "$OUT" $(cd "$OUT" && ls serve_spy* spy-client-*) && (cd "$OUT" && rm -f serve_spy* spy-client-*) ;;
  seeded)      # the seeded stall: three runs, and which Triton kernels each compiled while it ran
    setup
    python -m pip install -q --no-index --no-deps --target /tmp/spy "$REPO"/.prof/*.whl >/dev/null 2>&1
    for k in 1 2 3; do
      export TRITON_CACHE_DIR=/tmp/tcache-seeded-$k
      t0=$(date +%s.%N)
      echo "enc2dec bench --model google/flan-t5-large ... --temperature 0.8 --top-p 0.95 --sampling-seed 0 (run $k)" >>"$OUT/commands.txt"
      spy=""; [ -x /tmp/spy/bin/py-spy ] && spy="/tmp/spy/bin/py-spy record --threads --nonblocking -r 250 -f raw -o $OUT/seeded-$k.raw --"
      timeout 150 $spy python -m enc2dec.cli.main bench --model google/flan-t5-large --load-format dummy --dtype bfloat16 \
          --quiet --warmup 1 --max-batch-size 64 --input-len 128 --output-len 128 --concurrency 64 --num-requests 256 \
          --temperature 0.8 --top-p 0.95 --sampling-seed 0 --report-json "$OUT/seeded-$k.json" >"$OUT/seeded-$k.log" 2>&1
      python - "$OUT/seeded-$k.json" "$TRITON_CACHE_DIR" "$t0" <<'PY'
import json, os, pathlib, sys
lv = json.loads(pathlib.Path(sys.argv[1]).read_text())["levels"][0]
print("seeded", sys.argv[1][-6], round(lv["out_tok_per_s"]), "TPOT", round(lv["mean_tpot_ms"], 2),
      "TTFT mean/p99", round(lv["mean_ttft_ms"]), lv.get("p99_ttft_ms"), "e2e p99", lv.get("p99_e2e_ms"))
t0 = float(sys.argv[3])
ks = sorted((p.stat().st_mtime - t0, p.parent.name[:8], p.name) for p in pathlib.Path(sys.argv[2]).rglob("*.json")
            if not p.name.startswith("__grp"))
for t, h, n in ks:
    print(f"  compiled +{t:6.1f} s {n}")
PY
    done 2>&1 | tee "$OUT/seeded.txt" | grep "^seeded"
    tar -czf "$OUT/seeded.tgz" -C "$OUT" $(cd "$OUT" && ls seeded-*) && (cd "$OUT" && rm -f seeded-*) ;;
  tile)        # the tile GEMM (tuning.tile_gemm) in one ~9-minute call: its GPU tests (split K too),
               # the engine's GPU tests with it on, the 64-row configuration sweep of flan-t5-large's and
               # whisper-large-v3's products saved as a tile_gemm_configs file ($OUT/tilecfg.json), a step's
               # products as one chain with them (gemm_probe.py --chain --configs), then
               # flan-t5-large and whisper-large-v3 C=64: the defaults (base), the tile GEMM's built-in
               # rule (tile), the sweep's configurations (cfg). TILE_SWEEP_END / TILE_TOTAL: seconds into
               # the step at which the sweep stops / the benches stop (default 300 / 545).
    setup
    t0=$SECONDS
    timeout 80 python -m pytest -q -m gpu tests/test_kernels_gpu.py -k "tile or programmatic" 2>&1 | tail -2
    timeout 60 python -m pytest -q tests/test_kernels.py -k "split or tile_linear or measured" 2>&1 | tail -2
    ENC2DEC_TILE_GEMM=1 timeout 120 python -m pytest -q -x -m gpu tests/test_gpu_engine.py 2>&1 | tail -2
    echo "python bench/scripts/gemm_probe.py --rows 64 --models flan-t5-large,whisper-large-v3 --triton --pdl --save-configs tilecfg.json" >>"$OUT/commands.txt"
    (cd bench/scripts && timeout $((${TILE_SWEEP_END:-300} - (SECONDS - t0))) python gemm_probe.py --rows 64 \
        --models flan-t5-large,whisper-large-v3 --triton --pdl --save-configs /tmp/tilecfg.json \
        --json "$OUT/gemm_probe.json" 2>&1 | grep -v Warning | tail -14)
    cp /tmp/tilecfg.json "$OUT/" 2>/dev/null
    (cd bench/scripts && timeout 50 python gemm_probe.py --chain --rows 64 --models flan-t5-large,whisper-large-v3 \
        --configs /tmp/tilecfg.json 2>&1 | grep -v Warning | tail -3)
    OUT=$OUT/tile WORK=/tmp/rw-tile TOTAL_S=$((${TILE_TOTAL:-545} - (SECONDS - t0))) NUM_REQUESTS=192 \
      NUM_REQUESTS_WHISPER=128 AB="base: tile:ENC2DEC_TILE_GEMM=1 cfg:ENC2DEC_TILE_GEMM=1,ENC2DEC_TILE_GEMM_CONFIGS=/tmp/tilecfg.json" \
      bash bench/scripts/real_workloads.sh t5-ab wh-ab
    python bench/scripts/summarize.py /tmp/rw-tile 2>&1 | tail -8 ;;
  tileab)      # whether the tile GEMM goes on by default: its tests, then flan-t5-large and whisper-large-v3
               # C=64 and bart-large-cnn C=128 with the defaults (base) and the tile GEMM (tile; batched
               # pre-norms stay outside it, tuning.tile_gemm_norms off: session 40)
    setup
    timeout 60 python -m pytest -q -m gpu tests/test_kernels_gpu.py -k "tile or programmatic" 2>&1 | tail -1
    ENC2DEC_TILE_GEMM=1 timeout 150 python -m pytest -q -x -m gpu tests/test_gpu_engine.py 2>&1 | tail -1
    T=ENC2DEC_TILE_GEMM=1
    OUT=$OUT/tileab WORK=/tmp/rw-tileab TOTAL_S=$((${TILEAB_TOTAL:-560} - SECONDS)) NUM_REQUESTS=192 \
      NUM_REQUESTS_WHISPER=128 NUM_REQUESTS_BIG=1024 AB="base: tile:$T" bash bench/scripts/real_workloads.sh t5-ab bart-ab wh-ab
    python bench/scripts/summarize.py /tmp/rw-tileab 2>&1 | tail -8 ;;
  decide)      # the two defaults session 40 left open, in one call: the tile GEMM (t5, whisper, bart C=64 and
               # C=128) and the encoder bound per decoding row (t5 C=64, bart C=64 beside the fixed 2,048 and C=128)
    setup
    timeout 60 python -m pytest -q -m gpu tests/test_kernels_gpu.py -k "tile or programmatic" 2>&1 | tail -1
    T=ENC2DEC_TILE_GEMM=1 ROW=ENC2DEC_ENCODER_TOKENS_PER_DECODING_ROW=${ROW_TOKENS:-40}
    C64=--concurrency=64,--max-batch-size=64
    OUT=$OUT/decide-t5 WORK=/tmp/rw-d1 TOTAL_S=130 NUM_REQUESTS=192 AB="base: tile:$T row:$ROW" \
      bash bench/scripts/real_workloads.sh warm t5-ab
    OUT=$OUT/decide-wh WORK=/tmp/rw-d2 TOTAL_S=75 NUM_REQUESTS_WHISPER=128 AB="base: tile:$T" \
      bash bench/scripts/real_workloads.sh wh-ab
    OUT=$OUT/decide-bart WORK=/tmp/rw-d3 TOTAL_S=$((${DECIDE_TOTAL:-560} - SECONDS)) NUM_REQUESTS_BIG=1536 \
      AB="fit: tile:$T row:$ROW c64:$C64 c64tile:$T,$C64 c64row:$ROW,$C64 c64b2k:ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=2048,$C64" \
      bash bench/scripts/real_workloads.sh bart-ab
    for w in /tmp/rw-d1 /tmp/rw-d2 /tmp/rw-d3; do python bench/scripts/summarize.py $w 2>&1 | grep -E "^(t5|wh|bart|warm)-"; done ;;
  budget)      # issue 19's ITL rule (p99 within 3x p50) for bart-large-cnn 384/128 without losing out tok/s:
               # the encoder bound per decoding row (tuning.encoder_tokens_per_decoding_row, 40) against the
               # default (unbounded) and the fixed bounds that suited one concurrency each (2,048 at C=64,
               # 4,096 at C=128; sessions 33-34), at C=64 and C=128, 2,048 requests each (~5 min).
    setup
    ROW=ENC2DEC_ENCODER_TOKENS_PER_DECODING_ROW=${ROW_TOKENS:-40} C64=--concurrency=64,--max-batch-size=64
    OUT=$OUT/budget WORK=/tmp/rw-budget TOTAL_S=${BUDGET_TOTAL:-300} NUM_REQUESTS_BIG=2048 \
      AB="c64:$C64 c64row:$ROW,$C64 c64b2k:ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=2048,$C64 \
          fit: row:$ROW b4k:ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=4096" \
      bash bench/scripts/real_workloads.sh warm bart-ab
    python bench/scripts/summarize.py /tmp/rw-budget 2>&1 | tail -8 ;;
  *) echo "unknown step $1"; exit 2 ;;
  esac
  shift
done
