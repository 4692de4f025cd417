"""Long-form accuracy and speed of ``enc2dec transcribe`` (each strategy) against faster-whisper
on files composed of the LibriVox clips of shared/tools/real_models.py. A lab script
(bench/scripts is not installed); CPU, float32, greedy (``--beam 5``: beam search on both sides).

    python bench/scripts/longform_wer.py /tmp/longform --models tiny.en,base
    python bench/scripts/longform_wer.py /tmp/longform --models base --files shuffle_300s --rounds 3  # speed

Builds the compositions into the folder (deterministic: same files every run), runs
``enc2dec transcribe --strategy S`` once per file and strategy, and faster-whisper from its own
venv (``--fw-python``, a subprocess: the project never imports it) as
``BatchedInferencePipeline`` (batch 8, its default VAD) and ``WhisperModel.transcribe``
(temperature 0, no previous text: the sequential algorithm). Prints one table: WER after
Whisper's English normaliser, wall seconds (transcription only, no model load), and the
longest run of consecutive deleted reference words with where it lies in the audio.

Compositions (16 kHz):
  shuffle_300s  clips in a seeded random order, short pauses: every phrase recurs ~10 times
  repeats_300s  every clip twice in a row (A A B B ...): a repeated phrase straddles every
                30 s window join whatever the window plan
  pauses_180s   20 s of silence first, then clips apart by 2-12 s silences (VAD, silent overlaps)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SR = 16000
STRATEGIES = ("chunked", "sequential", "vad")
# ``STRATEGY+VARIANT`` engines: the strategy with these CLI options, e.g. vad+fallback
VARIANTS = {"fallback": ["--temperature", "0,0.2,0.4,0.6,0.8,1.0"]}
FW_MODES = ("fw-batched", "fw-sequential")

FW_SCRIPT = r"""
import json, sys, time
import ctranslate2, faster_whisper
from faster_whisper import BatchedInferencePipeline, WhisperModel
a = json.loads(sys.argv[1])
model = WhisperModel(a["model"], device="cpu", compute_type="float32", cpu_threads=a["threads"])
t0 = time.perf_counter()
if a["mode"] == "fw-batched":
    segments, _ = BatchedInferencePipeline(model).transcribe(a["audio"], batch_size=8, beam_size=a["beam"])
else:
    segments, _ = model.transcribe(a["audio"], beam_size=a["beam"], temperature=0.0, condition_on_previous_text=False)
text = " ".join(s.text.strip() for s in segments)
print(json.dumps({"text": text, "wall_s": time.perf_counter() - t0,
                  "versions": f"faster-whisper {faster_whisper.__version__}, ctranslate2 {ctranslate2.__version__}"}))
"""


@dataclass
class Composition:
    name: str
    path: Path
    words: list[str]            # the normalised reference, word by word
    word_times_s: list[float]   # where each reference word is spoken (interpolated in its clip)


def _clips(speech: Path, normalise) -> list[tuple[np.ndarray, list[str]]]:
    import soundfile as sf

    out = []
    for line in open(speech / "manifest.jsonl"):
        row = json.loads(line)
        wave, rate = sf.read(str(speech / row["audio"]), dtype="float32")
        assert rate == SR, row["audio"]
        out.append((wave, normalise(row["text"]).split()))
    return out


def _layout(name: str, num_clips: int, rng: np.random.Generator) -> tuple[float, list[tuple[int, float]]]:
    """(leading silence, [(clip index, pause after it)]) for a composition, before durations."""
    if name == "shuffle_300s":
        order, last = [], -1
        for _ in range(200):
            k = int(rng.choice([i for i in range(num_clips) if i != last]))
            order.append((k, float(rng.uniform(0.15, 0.9))))
            last = k
        return 0.0, order
    if name == "repeats_300s":
        order = []
        for r in range(100):
            k = r % num_clips
            order += [(k, float(rng.uniform(0.2, 0.5))), (k, float(rng.uniform(0.3, 0.9)))]
        return 0.0, order
    if name == "pauses_180s":
        return 20.0, [(int(rng.integers(num_clips)), float(rng.uniform(2.0, 12.0))) for _ in range(100)]
    raise ValueError(name)


def compose(folder: Path, speech: Path, normalise) -> list[Composition]:
    import soundfile as sf

    clips = _clips(speech, normalise)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("shuffle_300s", "repeats_300s", "pauses_180s"):
        limit_s = float(re.search(r"(\d+)s$", name).group(1))
        lead_s, order = _layout(name, len(clips), np.random.default_rng(18))
        parts, words, times = [np.zeros(int(lead_s * SR), np.float32)], [], []
        t = lead_s
        for k, pause_s in order:
            wave, clip_words = clips[k]
            if t + len(wave) / SR > limit_s:
                break
            dur = len(wave) / SR
            words += clip_words
            times += [t + dur * (i + 0.5) / len(clip_words) for i in range(len(clip_words))]
            parts += [wave, np.zeros(int(pause_s * SR), np.float32)]
            t += dur + pause_s
        path = folder / f"{name}.wav"
        sf.write(path, np.concatenate(parts), SR)
        out.append(Composition(name, path, words, times))
    return out


def _normaliser(model_dir: Path):
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spelling = model_dir / "normalizer.json"
    return EnglishTextNormalizer(json.load(open(spelling)) if spelling.exists() else {})


def run_enc2dec(model_dir: Path, strategy: str, audio: Path, beam: int = 1,
                pythonpath: str | None = None) -> tuple[str, float]:
    """The text (plain txt on stdout, as a user runs it) and the wall seconds the summary reports
    (transcription only, without the model load). ``strategy`` may carry a ``+VARIANT``."""
    cli = Path(sys.executable).with_name("enc2dec")
    strategy, _, variant = strategy.partition("+")
    cmd = [str(cli), "transcribe", str(audio), "--model", str(model_dir), "--strategy", strategy,
           "--dtype", "float32", "--device", "cpu", "--quiet", "--beam-size", str(beam), *VARIANTS.get(variant, [])]
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    wall = re.search(r"of audio in ([\d.]+) s", r.stderr)
    return r.stdout, float(wall.group(1))


def run_fw(fw_python: str, ct2_dir: Path, mode: str, audio: Path, threads: int,
           beam: int = 1) -> tuple[str, float, str]:
    arg = json.dumps({"model": str(ct2_dir), "mode": mode, "audio": str(audio), "threads": threads, "beam": beam})
    r = subprocess.run([fw_python, "-c", FW_SCRIPT, arg], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"faster-whisper {mode} failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["text"], out["wall_s"], out["versions"]


def score(comp: Composition, hyp_words: list[str]) -> tuple[float, int, str]:
    """WER, the longest run of consecutive deleted reference words, and where it starts."""
    import jiwer

    res = jiwer.process_words(" ".join(comp.words), " ".join(hyp_words) or "<empty>")
    longest, where = 0, "-"
    for chunk in res.alignments[0]:
        n = chunk.ref_end_idx - chunk.ref_start_idx
        if chunk.type == "delete" and n > longest:
            i = chunk.ref_start_idx
            longest = n
            where = f"{comp.word_times_s[i]:.1f}s '{' '.join(comp.words[i:i + 4])}...'"
    return res.wer, longest, where


def _versions() -> str:
    from importlib.metadata import version as v

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    parts = [f"enc2dec {v('enc2dec')} ({commit})", f"torch {v('torch')}", f"transformers {v('transformers')}"]
    try:
        parts.append(f"silero-vad {v('silero-vad')}")
    except Exception:  # noqa: BLE001 - the vad extra is optional
        parts.append("silero-vad not installed")
    return ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="where the composed wav files and outputs go")
    p.add_argument("--real", type=Path, default=Path(os.environ.get("ENC2DEC_REAL_MODELS")
                                                     or Path.home() / ".cache" / "enc2dec-real"))
    p.add_argument("--models", default="tiny.en,base", help="comma list of tiny.en, base")
    p.add_argument("--engines", default=",".join(STRATEGIES + FW_MODES),
                   help=f"comma list of {', '.join(STRATEGIES + FW_MODES)}; a strategy may take a "
                        f"+VARIANT ({', '.join(VARIANTS)}), e.g. vad+fallback")
    p.add_argument("--files", default="", help="comma list of composition names (default: all)")
    p.add_argument("--fw-python", default="/work/fw-venv/bin/python")
    p.add_argument("--threads", type=int, default=2, help="faster-whisper cpu_threads")
    p.add_argument("--beam", type=int, default=1, help="beam width for every engine (1: greedy)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times per file, interleaved (A B A B ...), for wall times "
                        "on a shared machine; the table then gives the median wall and the range")
    p.add_argument("--baseline-src", default=None,
                   help="a folder holding another enc2dec tree as enc2dec/ (e.g. from git archive --prefix=enc2dec/): "
                        "each enc2dec strategy also runs from it (PYTHONPATH), right after this tree's run")
    a = p.parse_args()
    engines = [e for e in a.engines.split(",") if e]
    if a.baseline_src:
        engines = [x for e in engines for x in ([e, f"{e}@baseline"] if e.partition("+")[0] in STRATEGIES
                                                 else [e])]
    comps = compose(a.folder, a.real / "speech", _normaliser(a.real / "whisper-base"))
    if a.files:
        comps = [c for c in comps if c.name in a.files.split(",")]
    rows, fw_versions = [], ""
    for model in a.models.split(","):
        hf_dir, ct2_dir = a.real / f"whisper-{model}", a.real / f"ct2-whisper-{model}"
        norm = _normaliser(hf_dir)
        for comp in comps:
            walls: dict[str, list[float]] = {}
            for r in range(a.rounds):
                for engine in engines:
                    strategy = engine.removesuffix("@baseline")
                    if strategy.partition("+")[0] in STRATEGIES:
                        src = a.baseline_src if engine.endswith("@baseline") else None
                        text, wall_s = run_enc2dec(hf_dir, strategy, comp.path, a.beam, src)
                        label = f"enc2dec {strategy}" + (f" ({src})" if src else "")
                    else:
                        text, wall_s, fw_versions = run_fw(a.fw_python, ct2_dir, engine, comp.path, a.threads, a.beam)
                        label = engine
                    if a.beam > 1:
                        label += f" beam {a.beam}"
                    walls.setdefault(label, []).append(wall_s)
                    wer, longest, where = score(comp, norm(text).split())
                    if r == 0:
                        rows.append([model, comp.name, label, wer, walls[label], longest, where])
                    print(f"{model:8} {comp.name:13} {label:20} WER {wer:6.2%}  wall {wall_s:6.1f} s  "
                          f"longest deletion {longest:3} at {where}", file=sys.stderr, flush=True)
    print(f"# {_versions()}; {fw_versions or 'faster-whisper not run'}; {os.cpu_count()} CPUs")
    print(f"| model | file | engine | WER | wall (s){' median (range)' if a.rounds > 1 else ''} | longest deleted run "
          "(words) | at |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for model, name, label, wer, walls, longest, where in rows:
        wall = f"{np.median(walls):.1f}" + (f" ({min(walls):.1f}-{max(walls):.1f})" if len(walls) > 1 else "")
        print(f"| {model} | {name} | {label} | {wer:.2%} | {wall} | {longest} | {where} |")


if __name__ == "__main__":
    main()
