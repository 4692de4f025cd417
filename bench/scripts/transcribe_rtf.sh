#!/usr/bin/env bash
# Real-time factor of `enc2dec transcribe` for each long-form strategy: whisper-large-v3 with
# dummy (random) bf16 weights on 10 minutes of synthetic audio, as one 600 s file and as
# 8 files of 75 s. One model load; each run has its own time limit. Prints a short table and
# writes $OUT/transcribe_rtf.json.
#
#   OUT=./rtf-out bench/scripts/transcribe_rtf.sh
#   env: MODEL (openai/whisper-large-v3), DTYPE (bfloat16), TOTAL_S (600), RUN_LIMIT_S (150),
#        BATCH_SIZE (32)
#
# RTF here is audio seconds per wall second (higher is faster), as `enc2dec bench` reports it.
# Random weights decode no words: every window runs to the 224-token cap unless EOT comes by
# chance, about twice the tokens of dense real speech, so these are pessimistic numbers.
set -uo pipefail
cd "$(dirname "$0")/../.."   # the repository root
export OUT=$(realpath -m "${OUT:-./rtf-out}"); mkdir -p "$OUT/audio"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python - <<'EOF'
import asyncio, json, os, time

import numpy as np
import soundfile as sf

from enc2dec.bench.audio import synthetic_clip
from enc2dec.engine import LLM, KvCacheConfig, LlmArgs
from enc2dec.engine.whisper.transcribe import transcribe, transcribe_async
from enc2dec.engine.whisper.tokens import id_only_tokenizer_for

out, model = os.environ["OUT"], os.environ.get("MODEL", "openai/whisper-large-v3")
total_s, limit_s = float(os.environ.get("TOTAL_S", 600)), float(os.environ.get("RUN_LIMIT_S", 150))
batch_size = int(os.environ.get("BATCH_SIZE", 32))
sr = 16000


def write(name, seconds, seed):
    # 30 s pieces of speech-band noise with a slow envelope (log-mel that is not silence).
    pieces = [synthetic_clip(min(30.0, seconds - k), seed * 1000 + i) for i, k in enumerate(np.arange(0, seconds, 30))]
    path = os.path.join(out, "audio", name)
    sf.write(path, np.concatenate(pieces), sr)
    return path


one = [write("long_600s.wav", total_s, 0)]
eight = [write(f"part{i}.wav", total_s / 8, i + 1) for i in range(8)]
warm = [write("warm.wav", 40.0, 99)]

args = LlmArgs.from_dict({}, model=model, load_format="dummy", dtype=os.environ.get("DTYPE", "bfloat16"),
                         kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5),
                         tokenizer=id_only_tokenizer_for(model, "dummy"))
t0 = time.perf_counter()
llm = LLM.from_args(args)
load_s = time.perf_counter() - t0
print(f"loaded {model} (dummy, {args.dtype}) in {load_s:.1f} s", flush=True)
for strategy in ("chunked", "sequential"):          # warm-up: first-use kernels, allocator
    transcribe(llm, warm, strategy=strategy, language="en", batch_size=batch_size)

rows = []
for label, files in ((f"1 x {total_s:g} s", one), (f"8 x {total_s / 8:g} s", eight)):
    for strategy in ("chunked", "sequential"):
        t0 = time.perf_counter()
        try:
            results = asyncio.run(asyncio.wait_for(transcribe_async(
                llm, files, strategy=strategy, language="en", batch_size=batch_size), limit_s))
            status = "ok" if all(r.error is None for r in results) else "; ".join(
                r.error for r in results if r.error)[:80]
        except asyncio.TimeoutError:
            results, status = [], f"timeout after {limit_s:.0f} s"
        wall = time.perf_counter() - t0
        audio = sum(sf.info(f).duration for f in files)
        row = dict(files=label, strategy=strategy, audio_s=round(audio, 1), wall_s=round(wall, 2),
                   rtf=round(audio / wall, 1) if results else None,
                   windows=sum(r.num_windows for r in results), tokens=sum(r.num_tokens for r in results),
                   status=status)
        row["tok_per_s"] = round(row["tokens"] / wall, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
llm.shutdown()

import torch
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
with open(os.path.join(out, "transcribe_rtf.json"), "w") as f:
    json.dump(dict(model=model, dtype=args.dtype, device=device, load_s=round(load_s, 1),
                   batch_size=batch_size, runs=rows), f, indent=2)
print(f"\nenc2dec transcribe, {model} dummy {args.dtype}, {device}, batch size {batch_size}")
print(f"{'files':<10} {'strategy':<11} {'audio s':>8} {'wall s':>8} {'RTF':>7} {'windows':>8} {'tokens':>7} "
      f"{'tok/s':>8}  status")
for r in rows:
    rtf = f"{r['rtf']:.1f}x" if r["rtf"] else "-"
    print(f"{r['files']:<10} {r['strategy']:<11} {r['audio_s']:>8.1f} {r['wall_s']:>8.1f} {rtf:>7} "
          f"{r['windows']:>8} {r['tokens']:>7} {r['tok_per_s']:>8.1f}  {r['status']}")
EOF
