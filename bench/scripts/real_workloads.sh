#!/usr/bin/env bash
# Issue 17's target workloads on one H200 in one call (about 9 minutes), a short table last:
#   sampled  flan-t5-large 128/128 at C=64: greedy, temperature 0.8 top-p 0.95, the same seeded
#            (t5: greedy and sampled only; greedy: greedy only, e.g. beside serve)
#   whisper  whisper-large-v3 30 s / 96 tokens at C=64: plain, --timestamps, --detect-language, and
#            63 plain requests beside one timestamped (--timestamps-every 64)
#   serve    enc2dec serve flan-t5-large (dummy, loopback, in the background, waited for /health) with
#            serve's default (auto) and --api-processes 1 (SERVE_API), each + bench --url --streaming at C=64,
#            against sampled's greedy in-process figure
#            (SERVE_BENCH_ARGS: more bench flags for the --url runs, e.g. --client-processes 8; SERVE_TAG
#            names the runs)
#   pairs    in-process greedy and serve (auto) alternating PAIRS times (default 2), a ratio per pair
#   stream   flan-t5-large greedy in-process with --streaming: what a stream costs the engine
#            itself, the in-process side of serve's figure
#   warm     a short flan-t5-large run first, not compared: a freshly started machine stalls its first
#            run's first tokens (docs/benchmarks.md, Run O)
#   desync   flan-t5-large greedy with output lengths spread (--output-dist uniform), in-process and
#            through serve (auto): the same workload without the synchronised waves of fixed lengths
#   fast     whisper-large-v3-turbo at C=64 and flan-t5-base at C=256, each against hf-compile
#            (turbo, t5base: the first or the second of the two only; turbo-unbounded: turbo again without the
#            one-clip-per-decoding-step encoder budget, no baseline; turbo-budgets: the budgets in
#            TURBO_BUDGETS, encoder tokens per decoding step)
#   turbo-join turbo with a request's encode joining k decoding steps later (TURBO_JOINS, k:budget
#            pairs, budget 0 = the default), against turbo-hfc's enc2dec figure
#   fp8      whisper-large-v3 (and flan-t5-large) at C=64 with --kv-cache-dtype fp8, against the
#            same runs with bf16 KV (wh-plain, t5-greedy: run those sections in the same call)
#   desync-ab flan-t5-large and whisper-large-v3 with lengths spread, the encoder beside the decoder
#            (ENC2DEC_ENCODER_BESIDE_DECODER=1, experimental) against the encoder inside the step
#   turbo-ab, wh-ab  turbo (whisper-large-v3) once per AB entry (NAME:VAR=v,--flag=v: tuning
#            variables and extra bench flags for that run), each against turbo-hfc's (wh-plain's)
#            enc2dec figure of the same call; fp8-ab: whisper-large-v3 with --kv-cache-dtype fp8 the
#            same way, against fp8's wh-fp8; t5-ab: flan-t5-large greedy the same way, against
#            greedy's t5-greedy; t5base-ab: flan-t5-base at C=256 the same way, no baseline (against
#            t5base's enc2dec figure); bart-ab: bart-large-cnn 384/128 at C=128 (issue 19's row) the same
#            way, no reference run (compare its entries in the summarize.py table)
#   wh-rest  whisper-large-v3 --detect-language and 63 + 1 timestamped (the whisper section without plain and --timestamps, for a call that has run those)
#   itl      the encoder budget of decoding steps (tuning.encoder_tokens_while_decoding): whisper-large-v3
#            C=64 and bart-large-cnn 384/128 C=128, each with the default budget and with the old
#            unbounded admission (the variable at 8192): ITL p50 / p99 and out tok/s side by side
# Every compared run has the same workload flags; dummy weights, bf16, one run each.
# Requests a run: NUM_REQUESTS (128) for flan-t5-large and turbo, NUM_REQUESTS_WHISPER (512, or
# NUM_REQUESTS where that is set) for whisper-large-v3, NUM_REQUESTS_BIG (256) for flan-t5-base and bart.
#
#   OUT=./gpu-out bash bench/scripts/real_workloads.sh [sampled whisper serve fast]
#   STALL_LOG=1 ...: each run under bench/scripts/jit_log, its slow steps counted in the table
#
# Runs stop at their own limit (*_LIMIT_S) and at the call's budget (TOTAL_S, default 540 s):
# a run that would start past it is skipped and its row says so. Reports and logs land in $WORK
# (default /tmp/rw-out), packed into $OUT/real_workloads.tgz. Serve's packages (fastapi, uvicorn,
# pydantic, python-multipart and their needs, annotated-doc and opentelemetry-api for fastapi, which the GPU image lacks) travel as wheels in .whl/
# (gitignored; carry it) and go into /tmp/site.
# SMOKE=1: a CPU dry run of the same logic with tiny models and sizes (flan-t5-small,
# whisper-tiny, a few requests, --baseline hf instead of hf-compile), so every command line
# parses and the table prints.
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
REPO=$PWD
export OUT=$(realpath -m "${OUT:-./gpu-out}")
export WORK=${WORK:-/tmp/rw-out}
mkdir -p "$OUT" "$WORK"
SECTIONS=${*:-sampled whisper serve fast}
TOTAL_S=${TOTAL_S:-540}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.done ] && [ -z "${SMOKE:-}" ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$REPO"/.whl/*.whl && touch /tmp/site/.done
fi
[ -d /tmp/site ] && [ -z "${SMOKE:-}" ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${SMOKE:-}" ]; then
  python -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 || tail -3 "$WORK/install.log"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  } | tee "$WORK/machine.txt"
fi
if [ -n "${COMMIT:-}" ]; then echo "$COMMIT"; else
  echo "$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)"; fi >"$WORK/commit.txt"

if [ -n "${SMOKE:-}" ]; then       # CPU: tiny models, a few short requests
  T5L=google/flan-t5-small T5B=google/flan-t5-small WH=openai/whisper-tiny WHT=openai/whisper-tiny
  BART=facebook/bart-large-cnn CBART=4 BTXT="--input-len 16 --output-len 8"
  DT=float32 C=4 CB=8 MIX=4 TXT="--input-len 16 --output-len 8" AUD="--audio-seconds 2 --output-len 6"
  NUM=8 NUMB=8 NUMW=8 FASTBASE=hf LIMIT=${LIMIT_S:-300}
else
  T5L=google/flan-t5-large T5B=google/flan-t5-base WH=openai/whisper-large-v3 WHT=openai/whisper-large-v3-turbo
  BART=facebook/bart-large-cnn CBART=128 BTXT="--input-len 384 --output-len 128"
  DT=bfloat16 C=64 CB=256 MIX=64 TXT="--input-len 128 --output-len 128" AUD="--audio-seconds 30 --output-len 96"
  NUM=${NUM_REQUESTS:-128} NUMB=${NUM_REQUESTS_BIG:-256} FASTBASE=hf-compile LIMIT=${LIMIT_S:-90}
  # whisper-large-v3 admits one clip a decoding step, so 128 requests at C=64 spend a third of the
  # run filling the batch (48 rows a step on average, docs/benchmarks.md session 33); 512 measure
  # the steady state for about 6 s more a run.
  NUMW=${NUM_REQUESTS_WHISPER:-${NUM_REQUESTS:-512}}
fi
B="python -m enc2dec.cli.main bench"
# One decoder row per request in flight: fewer CUDA-graph sizes to capture than the default 128.
COMMON="--load-format dummy --dtype $DT --quiet --warmup 1 --max-batch-size $C"
T5RUN="--model $T5L $COMMON $TXT --concurrency $C --num-requests $NUM"
WHRUN="--model $WH $COMMON $AUD --concurrency $C --num-requests $NUMW"

left() { echo $((TOTAL_S - SECONDS)); }
# STALL_LOG=1: every process of a run under bench/scripts/jit_log (slow engine steps with their
# stacks, Triton compiles, graph captures, long GC passes) into $WORK/NAME.events; the table
# counts each run's steps over STALL_MS (default 150) ms.
stall_env() { [ -n "${STALL_LOG:-}" ] && echo "PYTHONPATH=$REPO/bench/scripts/jit_log${PYTHONPATH:+:$PYTHONPATH} JIT_LOG=$WORK/$1.events"; }
run() {  # run NAME LIMIT ARGS...: one enc2dec bench, skipped when the budget is spent (ENV: "VAR=v" for this run)
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  local env=${RUN_ENV:-}
  local budget=$(left)
  if [ "$budget" -lt 20 ]; then echo "$name: skipped (budget spent)"; echo "$name" >>"$WORK/skipped.txt"; return; fi
  [ "$limit" -gt "$budget" ] && limit=$budget
  echo "${env:+$env }enc2dec bench $* --report-json $name.json" >>"$WORK/commands.txt"
  env $env $(stall_env "$name") timeout "$limit" $B "$@" --report-json "$WORK/$name.json" >"$WORK/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s"
}

serve_bench() {  # serve_bench N: enc2dec serve with N API processes in the background, bench --url --streaming, stop
  SERVE_N=$((${SERVE_N:-0} + 1))
  local api=$1 port=$((${PORT:-8765} + SERVE_N)) t0=$SECONDS flag="--api-processes $1"
  [ "$api" = auto ] && flag=""           # serve's default
  if [ "$(left)" -lt 60 ]; then echo "serve: skipped (budget spent)"; echo http-stream-a$api >>"$WORK/skipped.txt"; return; fi
  echo "enc2dec serve $T5L --load-format dummy --dtype $DT --max-batch-size $C --port $port $flag" >>"$WORK/commands.txt"
  env ${SERVE_ENV:-} $(stall_env "http-stream-a$api${SERVE_TAG:-}") python -m enc2dec.cli.main serve "$T5L" --load-format dummy --dtype "$DT" --max-batch-size "$C" \
      --host 127.0.0.1 --port "$port" --log-level warning $flag >"$WORK/serve-a$api.log" 2>&1 &
  local pid=$!
  if python - "$port" "${SERVE_WAIT_S:-150}" "$pid" <<'PY'
import os, sys, time, urllib.request
port, wait_s, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + wait_s
while time.monotonic() < end:
    try:
        os.kill(pid, 0)                      # the server died: stop waiting
    except OSError:
        sys.exit(1)
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(1)
PY
  then
    echo "serve (--api-processes $api): healthy after $((SECONDS - t0)) s"
    # bench's default client processes (one per 16 streams): one Python client would itself cap
    # the figure near 20k tok/s (bench/http_shards.py).
    run http-stream-a$api${SERVE_TAG:-} $LIMIT --url "http://127.0.0.1:$port" --streaming --quiet --warmup 1 $TXT \
        --concurrency "$C" --num-requests "$NUM" ${SERVE_BENCH_ARGS:-}
  else
    echo "serve: not healthy within ${SERVE_WAIT_S:-150} s; last lines of serve-a$api.log:"; tail -5 "$WORK/serve-a$api.log"
  fi
  kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}

# The fast section's two runs, each also a section of its own (turbo, t5base).
turbo_hfc() {
    run turbo-hfc ${FAST_LIMIT_S:-$((LIMIT * 2))} --model $WHT $COMMON $AUD --concurrency $C --num-requests $NUM \
        --baseline $FASTBASE
}
t5base_hfc() {
    run t5base-hfc ${FAST_LIMIT_S:-$((LIMIT * 2))} --model $T5B ${COMMON/--max-batch-size $C/--max-batch-size $CB} \
        $TXT --concurrency $CB --num-requests $NUMB --baseline $FASTBASE
}

for section in $SECTIONS; do
  echo "== $section ($(date -u +%H:%M:%S), $(left) s left)"
  case $section in
  greedy) run t5-greedy $LIMIT $T5RUN ;;
  t5)
    run t5-greedy $LIMIT $T5RUN
    run t5-sampled $LIMIT $T5RUN --temperature 0.8 --top-p 0.95 ;;
  warm)     # a throwaway first run: a machine that has just started stalls its first run's first tokens
    run warm-t5 $LIMIT --model $T5L $COMMON $TXT --concurrency $C --num-requests $C ;;
  stream) run t5-stream $LIMIT $T5RUN --streaming ;;
  desync)   # output lengths spread (uniform, +-25%): requests stop arriving in waves, in-process and over HTTP
    run t5-desync $LIMIT $T5RUN --output-dist uniform
    TXT_SAVED=$TXT; TXT="$TXT --output-dist uniform"; SERVE_TAG=-desync serve_bench auto; TXT=$TXT_SAVED ;;
  turbo-unbounded)
    RUN_ENV=ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=8192 run turbo-unbounded $LIMIT --model $WHT $COMMON $AUD \
        --concurrency $C --num-requests $NUM ;;
  turbo-budgets)   # turbo with encoder budgets between one clip per decoding step and unbounded
    for b in ${TURBO_BUDGETS:-3000 4500}; do
      RUN_ENV=ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=$b run turbo-enc$b $LIMIT --model $WHT $COMMON $AUD \
          --concurrency $C --num-requests $NUM
    done ;;
  turbo-join)   # turbo with encodes joining k decoding steps later (TURBO_JOINS: k:budget, budget 0 = default)
    for kb in ${TURBO_JOINS:-2:0 4:0 4:3000}; do
      k=${kb%%:*} b=${kb##*:}
      RUN_ENV="ENC2DEC_ENCODER_JOIN_STEPS=$k"
      [ "$b" != 0 ] && RUN_ENV="ENC2DEC_ENCODER_JOIN_STEPS=$k ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=$b"
      run turbo-join$k-enc$b $LIMIT --model $WHT $COMMON $AUD --concurrency $C --num-requests $NUM
    done
    RUN_ENV= ;;
  turbo-ab|wh-ab|fp8-ab|t5-ab|bart-ab|t5base-ab)   # one run per AB entry (see the header); AB: NAME:ITEM,ITEM
    # entries, an item VAR=v (the run's environment) or --flag=v (one more bench flag, e.g.
    # --kv-cache-dtype=fp8)
    for spec in ${AB:-j3:ENC2DEC_ENCODER_JOIN_STEPS=3}; do
      RUN_ENV= ab_args=()
      for item in $(tr , ' ' <<<"${spec#*:}"); do
        case $item in --*) ab_args+=("${item%%=*}" "${item#*=}") ;; *) RUN_ENV="$RUN_ENV $item" ;; esac
      done
      case $section in
        turbo-ab) run turbo-ab-${spec%%:*} $LIMIT --model $WHT $COMMON $AUD --concurrency $C --num-requests $NUM "${ab_args[@]}" ;;
        wh-ab) run wh-ab-${spec%%:*} $LIMIT $WHRUN "${ab_args[@]}" ;;
        fp8-ab) run wh-fp8-ab-${spec%%:*} $LIMIT $WHRUN --kv-cache-dtype fp8 "${ab_args[@]}" ;;
        t5-ab) run t5-ab-${spec%%:*} $LIMIT $T5RUN "${ab_args[@]}" ;;
        bart-ab) run bart-ab-${spec%%:*} $LIMIT --model $BART ${COMMON/--max-batch-size $C/--max-batch-size $CBART} \
                   $BTXT --concurrency $CBART --num-requests $NUMB "${ab_args[@]}" ;;
        t5base-ab) run t5base-ab-${spec%%:*} $LIMIT --model $T5B ${COMMON/--max-batch-size $C/--max-batch-size $CB} \
                   $TXT --concurrency $CB --num-requests $NUMB "${ab_args[@]}" ;;
      esac
    done
    RUN_ENV= ;;
  turbo) turbo_hfc ;;
  sampled)
    run t5-greedy $LIMIT $T5RUN
    run t5-sampled $LIMIT $T5RUN --temperature 0.8 --top-p 0.95
    run t5-seeded $LIMIT $T5RUN --temperature 0.8 --top-p 0.95 --sampling-seed 0 ;;
  whisper)
    run wh-plain $LIMIT $WHRUN
    run wh-timestamps $LIMIT $WHRUN --timestamps
    run wh-detect $LIMIT $WHRUN --detect-language
    run wh-mixed $LIMIT $WHRUN --timestamps-every $MIX ;;
  serve) for a in ${SERVE_API:-auto 1}; do serve_bench "$a"; done ;;
  pairs)   # in-process greedy and serve (auto) alternating, PAIRS times: the ratio's spread on one machine
    for k in $(seq "${PAIRS:-2}"); do
      run t5-greedy-p$k $LIMIT $T5RUN
      SERVE_TAG=-p$k serve_bench auto
    done ;;
  wh-plain) run wh-plain $LIMIT $WHRUN ;;
  wh-instep) RUN_ENV=ENC2DEC_ENCODER_BESIDE_DECODER=0 run wh-plain-instep $LIMIT $WHRUN ;;
  wh-rest)   # the whisper section's rows past plain and --timestamps
    run wh-detect $LIMIT $WHRUN --detect-language
    run wh-mixed $LIMIT $WHRUN --timestamps-every $MIX ;;
  desync-ab)   # lengths spread (arrivals out of step), the encoder beside the decoder and inside the step
    RUN_ENV=ENC2DEC_ENCODER_BESIDE_DECODER=1 run t5-desync-beside $LIMIT $T5RUN --output-dist uniform
    RUN_ENV=ENC2DEC_ENCODER_BESIDE_DECODER=0 run t5-desync-instep $LIMIT $T5RUN --output-dist uniform
    RUN_ENV=ENC2DEC_ENCODER_BESIDE_DECODER=1 run wh-desync-beside $LIMIT $WHRUN --output-dist uniform
    RUN_ENV=ENC2DEC_ENCODER_BESIDE_DECODER=0 run wh-desync-instep $LIMIT $WHRUN --output-dist uniform ;;
  wh-fp8) run wh-fp8 $LIMIT $WHRUN --kv-cache-dtype fp8 ;;
  fp8)
    run wh-fp8 $LIMIT $WHRUN --kv-cache-dtype fp8
    run t5-fp8 $LIMIT $T5RUN --kv-cache-dtype fp8 ;;
  itl)
    BARTRUN="--model $BART ${COMMON/--max-batch-size $C/--max-batch-size $CBART} $BTXT --concurrency $CBART --num-requests $NUMB"
    RUN_ENV=ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=8192 run wh-unbounded $LIMIT $WHRUN
    run wh-budget $LIMIT $WHRUN
    RUN_ENV=ENC2DEC_ENCODER_TOKENS_WHILE_DECODING=8192 run bart-unbounded $LIMIT $BARTRUN
    run bart-budget $LIMIT $BARTRUN ;;
  t5base) t5base_hfc ;;
  fast) turbo_hfc; t5base_hfc ;;
  *) echo "unknown section $section" ;;
  esac
done
tar -czf "$OUT/real_workloads.tgz" -C "$WORK" . 2>/dev/null
python - "$WORK" "$FASTBASE" "$C" "$CB" <<'PY'
import json, pathlib, sys
work, fast_base, c, cb = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
skipped = set((work / "skipped.txt").read_text().split()) if (work / "skipped.txt").exists() else set()

def level(name, backend=None, conc=None):
    p = work / f"{name}.json"
    if not p.exists():
        return None
    levels = json.loads(p.read_text())["levels"]
    backend = backend or ("http" if name.startswith("http") else "enc2dec")
    return next((lv for lv in levels if lv["backend"] == backend and (conc is None or lv["concurrency"] == conc)), None)

def num(v, fmt="{:,.0f}"):
    return "-" if v is None else fmt.format(v)

# step: the engine's own mean step ms / decoder rows per step / share of step time waiting for the GPU
print(f"\n{'run':<17}{'backend':<12}{'C':>4}{'out tok/s':>11}{'TPOT ms':>9}{'TTFT ms':>9}{'ITL p50/p99':>14}{'fail':>5}"
      f"{'step ms/rows/wait':>20}{'eng TTFT/E2E':>14}{'slow':>5}  api in/1st hop/send/last hop")
for p in sorted(work.glob("*.json")):
    for lv in json.loads(p.read_text())["levels"]:
        itl = f"{num(lv.get('p50_itl_ms'), '{:.1f}')}/{num(lv.get('p99_itl_ms'), '{:.1f}')}"
        step = "-" if not lv.get("engine_steps") else (
            f"{lv['engine_step_ms']:.2f}/{lv['engine_rows_per_step']:.1f}/{num(lv.get('engine_device_wait_frac'), '{:.0%}')}")
        # the engine's own mean arrival->first token / arrival->finish of the requests it finished
        eng = "-" if lv.get("engine_e2e_ms") is None else f"{lv['engine_ttft_ms']:.0f}/{lv['engine_e2e_ms']:.0f}"
        # serve's phases of a stream outside the engine (docs/bench.md), mean ms
        api = "/".join(num(lv.get(f"api_{k}_ms"), "{:.1f}") for k in ("to_engine", "first_hop", "first_send", "finish_hop"))
        if lv.get("api_loop_lag_ms") is not None:   # serve's API event loops: mean lag of a 10 ms timer
            api += f" lag {lv['api_loop_lag_ms']:.2f}"
        if lv.get("client_lag_ms") is not None:     # the client processes: busiest CPU share, timer lag mean/p99
            api += f"  client {lv['client_cpu_frac']:.0%} {lv['client_lag_ms']:.2f}/{lv['client_lag_p99_ms']:.2f}"
        if lv.get("client_headers_ms") is not None:  # the client's send to the response's headers, mean
            api += f" hdr {lv['client_headers_ms']:.1f}"
        # STALL_LOG runs: engine steps over STALL_MS in the run's processes (start-up and warm-up included)
        events = work / f"{p.stem}.events"
        slow = "-" if not events.exists() or lv["backend"] not in ("enc2dec", "http") else \
            str(sum(" slow-step " in line for line in events.read_text().splitlines()))
        print(f"{p.stem:<17}{lv['backend']:<12}{lv['concurrency']:>4}{num(lv['out_tok_per_s']):>11}"
              f"{num(lv['mean_tpot_ms'], '{:.2f}'):>9}{num(lv['mean_ttft_ms'], '{:.0f}'):>9}{itl:>14}{lv['failed']:>5}"
              f"{step:>20}{eng:>14}{slow:>5}  {api}")
for name in sorted(skipped):
    print(f"{name:<14}skipped: the call's time budget was spent")

def ratio(a, b, key="out_tok_per_s"):
    return None if a is None or b is None or not b.get(key) else a[key] / b[key]

mixed = level("wh-mixed")
plain_tpot = (level("wh-plain") or {}).get("mean_tpot_ms")
mixed_plain_tpot = ((mixed or {}).get("groups") or {}).get("plain", {}).get("mean_tpot_ms")
rows = [
    ("t5 sampled / greedy", ratio(level("t5-sampled"), level("t5-greedy")), 0.95),
    ("t5 seeded / greedy", ratio(level("t5-seeded"), level("t5-greedy")), 0.95),
    ("whisper timestamps / plain", ratio(level("wh-timestamps"), level("wh-plain")), 0.90),
    ("whisper detect / plain", ratio(level("wh-detect"), level("wh-plain")), 0.95),
    ("whisper 63+1 / plain", ratio(mixed, level("wh-plain")), 0.95),
    ("  its plain TPOT vs plain run", plain_tpot / mixed_plain_tpot if plain_tpot and mixed_plain_tpot else None, 0.95),
    (f"turbo / {fast_base} C={c}", ratio(level("turbo-hfc", conc=c), level("turbo-hfc", fast_base, c)), 3.0),
    (f"flan-t5-base / {fast_base} C={cb}", ratio(level("t5base-hfc", conc=cb), level("t5base-hfc", fast_base, cb)), 3.0),
    ("serve stream / in-process, 1 API process", ratio(level("http-stream-a1"), level("t5-greedy")), 0.90),
    ("  --api-processes 2", ratio(level("http-stream-a2"), level("t5-greedy")), 0.90),
    ("  --api-processes 4", ratio(level("http-stream-a4"), level("t5-greedy")), 0.90),
    ("  --api-processes auto (the default)", ratio(level("http-stream-aauto"), level("t5-greedy")), 0.90),
    ("  auto / in-process --streaming", ratio(level("http-stream-aauto"), level("t5-stream")), 0.90),
    ("in-process --streaming / greedy", ratio(level("t5-stream"), level("t5-greedy")), 0.90),
    *[(f"serve / in-process, pair {p.stem[11:]}", ratio(level(f"http-stream-aauto-p{p.stem[11:]}"), level(p.stem)), 0.90)
      for p in sorted(work.glob("t5-greedy-p*.json"))],
    ("serve / in-process, lengths spread", ratio(level("http-stream-aauto-desync"), level("t5-desync")), 0.90),
    ("in-process lengths spread / fixed", ratio(level("t5-desync"), level("t5-greedy")), 1.0),
    ("turbo unbounded encoder / turbo", ratio(level("turbo-unbounded"), level("turbo-hfc", conc=c)), 1.0),
    *[(f"turbo {p.stem[6:]} / turbo", ratio(level(p.stem), level("turbo-hfc", conc=c)), 1.0)
      for p in sorted(work.glob("turbo-join*.json"))],
    *[(f"turbo {p.stem[9:]} / turbo", ratio(level(p.stem), level("turbo-hfc", conc=c)), 1.0)
      for p in sorted(work.glob("turbo-ab-*.json"))],
    *[(f"whisper {p.stem[6:]} / plain", ratio(level(p.stem), level("wh-plain")), 1.0)
      for p in sorted(work.glob("wh-ab-*.json"))],
    *[(f"whisper fp8 {p.stem[10:]} / fp8", ratio(level(p.stem), level("wh-fp8")), 1.0)
      for p in sorted(work.glob("wh-fp8-ab-*.json"))],
    *[(f"t5 {p.stem[6:]} / greedy", ratio(level(p.stem), level("t5-greedy")), 1.0)
      for p in sorted(work.glob("t5-ab-*.json"))],
    *[(f"flan-t5-base {p.stem[10:]} / t5base", ratio(level(p.stem), level("t5base-hfc", conc=cb)), 1.0)
      for p in sorted(work.glob("t5base-ab-*.json"))],
    ("t5 lengths spread: beside / in step", ratio(level("t5-desync-beside"), level("t5-desync-instep")), 1.0),
    ("whisper lengths spread: beside / in step", ratio(level("wh-desync-beside"), level("wh-desync-instep")), 1.0),
    ("whisper fp8 KV / bf16 KV", ratio(level("wh-fp8"), level("wh-plain")), 12000 / 9000),
    ("t5 fp8 KV / bf16 KV", ratio(level("t5-fp8"), level("t5-greedy")), 1.0),
]
print(f"\n{'target (out tok/s ratios)':<42}{'ratio':>8}{'target':>8}  met")
for name, r, target in rows:
    print(f"{name:<42}{num(r, '{:.3f}'):>8}{target:>8.2f}  {'-' if r is None else ('yes' if r >= target else 'NO')}")
PY
