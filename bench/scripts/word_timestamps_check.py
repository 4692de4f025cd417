"""Word timestamps of enc2dec against faster-whisper's and the transformers pipeline's on the
same checkpoint and audio: the median absolute difference of word starts and ends.

    python bench/scripts/word_timestamps_check.py --model ~/.cache/enc2dec-real/whisper-base \
        --ct2 ~/.cache/enc2dec-real/ct2-whisper-base --fw-python /work/fw-venv/bin/python

Clips default to the LibriVox manifest beside the real checkpoints. faster-whisper runs in
its own interpreter (``--fw-python``; this script re-runs itself there with ``--emit``), never
in the project's. All three decode greedily in float32 on the CPU; words are paired where the
normalised word sequences agree (difflib), so a peer's different wording cannot skew the times.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from statistics import median

SPEECH = os.path.expanduser("~/.cache/enc2dec-real/speech")


def clips_from_manifest(folder: str = SPEECH) -> list[str]:
    rows = [json.loads(line) for line in open(os.path.join(folder, "manifest.jsonl")) if line.strip()]
    return [os.path.join(folder, r["audio"]) for r in rows]


def joined(clips: list[str], times: int, path: str, gap_s: float = 0.5) -> str:
    """One long file: the clips ``times`` over, ``gap_s`` of silence after each."""
    import numpy as np
    import soundfile as sf

    waves = [sf.read(c, dtype="float32")[0] for c in clips]
    gap = np.zeros(int(gap_s * 16000), np.float32)
    sf.write(path, np.concatenate([x for _ in range(times) for w in waves for x in (w, gap)]), 16000)
    return path


# ---- the three engines: per clip, [(word, start_s, end_s)] -------------------------------------
def faster_whisper_words(ct2: str, clips: list[str], language: str = "en") -> list[list[tuple]]:
    from faster_whisper import WhisperModel

    model = WhisperModel(ct2, device="cpu", compute_type="float32")
    out = []
    for clip in clips:
        segments, _ = model.transcribe(clip, language=language, beam_size=1, temperature=0.0, word_timestamps=True,
                                       condition_on_previous_text=False, vad_filter=False)
        out.append([(w.word, w.start, w.end) for s in segments for w in s.words])
    return out


def faster_whisper_subprocess(python: str, ct2: str, clips: list[str], language: str = "en") -> list[list[tuple]]:
    cmd = [python, os.path.abspath(__file__), "--emit", "--ct2", ct2, "--language", language, *clips]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return [[tuple(w) for w in words] for words in json.loads(done.stdout.strip().splitlines()[-1])]


def enc2dec_words(llm, clips: list[str], language: str = "en", strategy: str = "sequential") -> list[list[tuple]]:
    from enc2dec.engine.whisper.transcribe import transcribe

    results = transcribe(llm, clips, language=language, word_timestamps=True, strategy=strategy)
    for t in results:
        if t.error:
            raise RuntimeError(f"{t.source}: {t.error}")
    return [[(w.word, w.start_s, w.end_s) for s in t.segments for w in s.words] for t in results]


def transformers_words(checkpoint: str, clips: list[str], language: str = "en") -> list[list[tuple]]:
    import soundfile as sf
    import torch
    from transformers import pipeline

    pipe = pipeline("automatic-speech-recognition", model=checkpoint, device="cpu", dtype=torch.float32,
                    chunk_length_s=30)      # long files: 30 s chunks (shorter clips are one chunk)
    multilingual = pipe.model.generation_config.is_multilingual
    out = []
    for clip in clips:
        wave, rate = sf.read(clip, dtype="float32")
        kwargs = {"language": language, "task": "transcribe"} if multilingual else {}
        r = pipe({"raw": wave, "sampling_rate": rate}, return_timestamps="word", generate_kwargs=kwargs)
        out.append([(c["text"], c["timestamp"][0], c["timestamp"][1]) for c in r["chunks"]])
    return out


# ---- comparison -----------------------------------------------------------------------------
def _norm(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def paired(ours: list[tuple], theirs: list[tuple]) -> list[tuple[tuple, tuple]]:
    """Word pairs where the two normalised word sequences agree."""
    a, b = [_norm(w[0]) for w in ours], [_norm(w[0]) for w in theirs]
    m = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(ours[i + k], theirs[j + k]) for i, j, n in m.get_matching_blocks() for k in range(n)]


def differences_ms(ours: list[list[tuple]], theirs: list[list[tuple]]) -> dict:
    pairs = [p for o, t in zip(ours, theirs) for p in paired(o, t)]
    total = sum(len(o) for o in ours)
    nan = float("nan")
    if not pairs:
        return {"num_words": total, "num_paired": 0, "start_ms": nan, "end_ms": nan, "mean_ms": nan, "max_ms": nan}
    diffs = [abs(x[k] - y[k]) for x, y in pairs for k in (1, 2)]
    return {"num_words": total, "num_paired": len(pairs),
            "start_ms": 1000 * median(abs(x[1] - y[1]) for x, y in pairs),
            "end_ms": 1000 * median(abs(x[2] - y[2]) for x, y in pairs),
            "mean_ms": 1000 * sum(diffs) / len(diffs), "max_ms": 1000 * max(diffs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clips", nargs="*", help="audio files (default: the LibriVox manifest clips)")
    ap.add_argument("--model", help="HF folder of the Whisper checkpoint (enc2dec and transformers)")
    ap.add_argument("--ct2", help="CTranslate2 folder of the same checkpoint (faster-whisper)")
    ap.add_argument("--fw-python", default="/work/fw-venv/bin/python", help="an interpreter with faster-whisper")
    ap.add_argument("--language", default="en")
    ap.add_argument("--strategy", default="sequential", help="enc2dec's long-form strategy")
    ap.add_argument("--join", type=int, default=0, metavar="N",
                    help="compare on one long file: the clips N times over, 0.5 s apart (long-form windows)")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)   # faster-whisper side: JSON out
    args = ap.parse_args()
    clips = args.clips or clips_from_manifest()
    if args.emit:
        print(json.dumps(faster_whisper_words(args.ct2, clips, args.language)))
        return 0
    if args.join:
        import tempfile

        clips = [joined(clips, args.join, os.path.join(tempfile.mkdtemp(), "joined.wav"))]
    from enc2dec.engine import LLM, KvCacheConfig

    with LLM(args.model, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        ours = enc2dec_words(llm, clips, args.language, args.strategy)
    peers = {"transformers pipeline": transformers_words(args.model, clips, args.language)}
    if args.ct2 and os.path.exists(args.fw_python):
        peers["faster-whisper"] = faster_whisper_subprocess(args.fw_python, args.ct2, clips, args.language)
    print(f"{len(clips)} clips, {sum(len(o) for o in ours)} words, model {args.model}, strategy {args.strategy}")
    print("| peer | words paired | median abs diff, start | median abs diff, end | mean (starts and ends) | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, theirs in peers.items():
        d = differences_ms(ours, theirs)
        print(f"| {name} | {d['num_paired']} of {d['num_words']} | {d['start_ms']:.0f} ms | {d['end_ms']:.0f} ms "
              f"| {d['mean_ms']:.0f} ms | {d['max_ms']:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
