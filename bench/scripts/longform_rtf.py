"""Long-form speed on a GPU: enc2dec's default long-form strategy against the transformers ASR
pipeline, on the same weights and the same long files. A lab script (bench/scripts is not
installed).

    python bench/scripts/longform_rtf.py --speech-dir real/speech                 # H200, ~6 min
    python bench/scripts/longform_rtf.py --speech-dir ~/.cache/enc2dec-real/speech \\
        --minutes 1 --files 2 --model ~/.cache/enc2dec-real/whisper-tiny.en        # CPU smoke run

Files: ``--files`` of ``--minutes`` each, composed (seeded, the same every run) from the LibriVox
clips of ``--speech-dir`` (a manifest.jsonl folder from shared/tools/real_models.py): clips in a
shuffled order with 0.3-1.2 s pauses and a 2-6 s silence about once a minute, so Silero VAD has
real speech and real pauses to find.

Models: each ``--model`` is a known name built with random weights (openai/whisper-large-v3 and
-turbo by default, from engine/inputs/known_configs.py as ``enc2dec bench --load-format dummy``
builds them, seeded) or a checkpoint folder. A random model is saved once (with a stand-in
tokenizer of the real special-token layout: there are no files and no hub here) and both peers
load that folder, so both run the SAME weights. A checkpoint folder's transcripts are also
scored: WER of each peer over all files against the clips' texts, after Whisper's English
normaliser (needs jiwer):

- enc2dec: one LLM, ``transcribe()`` over all files at once as ``enc2dec transcribe`` does
  (default strategy, timestamps, language en on multilingual checkpoints, batch 32);
- transformers: ``pipeline("automatic-speech-recognition", chunk_length_s=30, batch_size=24,
  return_timestamps=True)``, sdpa attention, the same dtype, over the same arrays;
  ``max_new_tokens`` per chunk equal to enc2dec's per-window cap (224).

Random weights decode every window to the cap, so the token counts are reported with the speeds:
"tokens/window" is decoder steps per window (enc2dec: generated tokens per engine request, retries
included; transformers: decoder steps per chunk, which counts its generate seeking again inside
a chunk whose last segment stays open). RTF is audio seconds per wall second (higher is faster),
after one untimed warm-up run of each peer on the first file's first 30 s; enc2dec's wall time
includes its VAD pass (onnxruntime on the CPU). VAD runs on the real speech, so enc2dec's windows
are the real ones. Nothing is downloaded: known configs, local files only.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shutil
import sys
import time
import wave as wavfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SR = 16000
DEFAULT_MODELS = "openai/whisper-large-v3,openai/whisper-large-v3-turbo"
HF_BATCH_SIZE = 24
ENGINE_BATCH_SIZE = 32         # enc2dec transcribe's --batch-size default
WARM_UP_S = 30                 # each peer first decodes this much of the first file, untimed


# ---- the long files ----------------------------------------------------------------------------
def _read_wav(path: Path) -> np.ndarray:
    """16 kHz mono PCM16 wav as float32, with the standard library (the GPU machine may lack soundfile)."""
    with wavfile.open(str(path)) as w:
        if w.getframerate() != SR or w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise SystemExit(f"{path}: expected 16 kHz mono 16-bit wav")
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def compose(speech_dir: Path, num_files: int, minutes: float, seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    """The files and their reference texts (the manifest's text of every clip that fits whole; a
    clip the length cuts is left out of both, its place silent)."""
    rows = [json.loads(line) for line in open(speech_dir / "manifest.jsonl") if line.strip()]
    clips = [_read_wav(speech_dir / row["audio"]) for row in rows]
    target = int(minutes * 60 * SR)
    files, refs = [], []
    for k in range(num_files):
        rng = random.Random(seed * 1000 + k)
        parts, texts, size, next_gap = [], [], 0, 60 * SR
        while size < target:
            order = list(range(len(clips)))
            rng.shuffle(order)
            for i in order:
                pause = rng.uniform(0.3, 1.2)
                if size >= next_gap:
                    pause, next_gap = rng.uniform(2.0, 6.0), next_gap + 60 * SR
                whole = size + len(clips[i]) <= target
                parts += [clips[i] if whole else np.zeros_like(clips[i]), np.zeros(int(pause * SR), np.float32)]
                texts += [rows[i]["text"]] if whole else []
                size += len(clips[i]) + int(pause * SR)
        files.append(np.concatenate(parts)[:target])
        refs.append(" ".join(texts))
    return files, refs


def word_error_rate(folder: str, refs: list[str], hyps: list[str]) -> float:
    """WER over all files together after Whisper's English normaliser (the checkpoint's spelling
    map when it has one), as bench/scripts/longform_wer.py scores."""
    import jiwer
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spelling = Path(folder) / "normalizer.json"
    norm = EnglishTextNormalizer(json.load(open(spelling)) if spelling.exists() else {})
    return jiwer.wer([norm(r) for r in refs], [norm(h) or "<empty>" for h in hyps])


# ---- one model folder both peers load ------------------------------------------------------------
def _stand_in_tokenizer(gen, vocab_size: int):
    """A byte-level BPE tokenizer with Whisper's special-token layout for ``gen`` (a generation
    config), for random weights with no tokenizer files: ids below <|endoftext|> decode as
    " w<id>" placeholders; the special tokens sit at the checkpoint's ids."""
    from transformers import WhisperTokenizer

    # GPT-2's reversible byte -> printable character map (the byte-level pre-tokenizer's alphabet).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    eot = gen.eos_token_id
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({f"\u0120w{i}": i for i in range(256, eot)})          # \u0120: the byte-level space
    languages = sorted(gen.lang_to_id.items(), key=lambda kv: kv[1])
    translate = gen.task_to_id["translate"]
    no_speech = "<|nospeech|>" if len(languages) >= 100 else "<|nocaptions|>"
    specials = ["<|endoftext|>", "<|startoftranscript|>"] + [t for t, _ in languages] + [
        "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", no_speech, "<|notimestamps|>"]
    assert eot + len(specials) - 1 == gen.no_timestamps_token_id == translate + 5, "unexpected Whisper layout"
    tok = WhisperTokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                           eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = tok.convert_tokens_to_ids(specials)
    assert ids == list(range(eot, eot + len(specials))), "stand-in tokenizer ids do not match the checkpoint"
    assert len(tok) + 1501 == vocab_size, (len(tok), vocab_size)        # + the 1501 timestamp tokens
    return tok


def model_folder(model: str, work_dir: Path, dtype, device: str, seed: int = 0) -> tuple[str, bool]:
    """(folder, is_random): a checkpoint folder as is, or a known name saved with seeded random weights."""
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model), False
    import torch
    from transformers import AutoModelForSpeechSeq2Seq, GenerationConfig, WhisperFeatureExtractor

    from enc2dec.engine.inputs.known_configs import get_known_config, get_known_generation_config

    folder = work_dir / model.replace("/", "--")
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return str(folder), True                # saved by an earlier run: the same seeded weights
    cfg, gen = get_known_config(model), get_known_generation_config(model)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):          # random init of 1.5 B parameters is minutes on a CPU, seconds on a GPU
        hf = AutoModelForSpeechSeq2Seq.from_config(cfg, dtype=dtype)
    hf.generation_config = gen
    # The known configs keep generation keys in the model config (as old hub folders do), which
    # save_pretrained refuses; they live in generation_config.json.
    model_keys = set(inspect.signature(type(hf.config).__init__).parameters)
    for key in set(GenerationConfig().to_dict()) - model_keys:
        if key in vars(hf.config):
            delattr(hf.config, key)
    shutil.rmtree(folder, ignore_errors=True)
    hf.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(folder)
    _stand_in_tokenizer(gen, cfg.vocab_size).save_pretrained(folder)
    del hf
    print(f"  saved random {model} ({dtype}) to {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return str(folder), True


# ---- the two peers ---------------------------------------------------------------------------------
@dataclass
class Run:
    peer: str
    audio_s: float
    wall_s: float
    num_windows: int
    num_tokens: int
    note: str = ""
    texts: tuple[str, ...] = ()

    @property
    def rtf(self) -> float:
        return self.audio_s / self.wall_s


def run_enc2dec(folder: str, files: list[np.ndarray], dtype: str, device: str, language: str | None) -> Run:
    from enc2dec.engine.launch import build_llm_args, start_llm
    from enc2dec.engine.whisper.transcribe import DEFAULT_STRATEGY, transcribe

    args = build_llm_args(folder, None, dtype=dtype, device=device)
    audio_s = sum(len(w) for w in files) / SR
    with start_llm(args) as llm:
        transcribe(llm, [(files[0][:WARM_UP_S * SR], SR)], language=language, timestamps=True)        # warm-up
        t0 = time.perf_counter()
        results = transcribe(llm, [(w, SR) for w in files], language=language, timestamps=True,
                             batch_size=ENGINE_BATCH_SIZE)
        wall_s = time.perf_counter() - t0
    failed = [t.error for t in results if t.error]
    if failed:
        raise SystemExit(f"enc2dec failed: {failed[0]}")
    return Run(f"enc2dec {DEFAULT_STRATEGY}", audio_s, wall_s, sum(t.num_windows for t in results),
               sum(t.num_tokens for t in results), f"{sum(len(t.segments) for t in results)} segments",
               tuple(t.text for t in results))


def run_pipeline(folder: str, files: list[np.ndarray], dtype, device: str, language: str | None,
                 max_new_tokens: int) -> Run:
    import torch
    from transformers import AutoModelForSpeechSeq2Seq, AutoTokenizer, WhisperFeatureExtractor, pipeline

    model = AutoModelForSpeechSeq2Seq.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
    tok, fe = AutoTokenizer.from_pretrained(folder), WhisperFeatureExtractor.from_pretrained(folder)
    gen = model.generation_config
    # Windows and tokens the pipeline decodes (it reports neither, and generate's returned ids are
    # rebuilt from the timestamp segments): rows per generate call, decoder steps per call.
    counts = {"rows": 0, "tokens": 0, "steps": 0}
    generate, forward = model.generate, model.forward

    def counted_generate(*a, **kw):
        counts["steps"] = 0
        out = generate(*a, **kw)
        features = next((kw[k] for k in ("input_features", "inputs") if kw.get(k) is not None), a[0] if a else None)
        rows = features.shape[0]
        counts["rows"] += rows
        counts["tokens"] += rows * max(0, counts["steps"] - 1)      # the first step reads the prefix
        return out

    def counted_forward(*a, **kw):
        counts["steps"] += 1
        return forward(*a, **kw)

    model.generate, model.forward = counted_generate, counted_forward
    pipe = pipeline("automatic-speech-recognition", model=model, tokenizer=tok, feature_extractor=fe,
                    chunk_length_s=30, batch_size=HF_BATCH_SIZE, dtype=dtype, device=torch.device(device))
    kw = {"max_new_tokens": max_new_tokens}
    if getattr(gen, "is_multilingual", False) and language:
        kw.update(language=language, task="transcribe")
    audio_s = sum(len(w) for w in files) / SR
    pipe({"raw": files[0][:WARM_UP_S * SR], "sampling_rate": SR}, return_timestamps=True,       # warm-up
         generate_kwargs=kw)
    counts.update(rows=0, tokens=0, steps=0)
    _sync(device)
    t0 = time.perf_counter()
    outs = pipe([{"raw": w, "sampling_rate": SR} for w in files], return_timestamps=True, generate_kwargs=kw)
    _sync(device)
    wall_s = time.perf_counter() - t0
    num_chunks = sum(len(o.get("chunks") or []) for o in outs)
    del pipe, model
    return Run("transformers pipeline", audio_s, wall_s, counts["rows"], counts["tokens"], f"{num_chunks} segments",
               tuple(o["text"] for o in outs))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speech-dir", required=True, help="folder with manifest.jsonl and the LibriVox clips")
    ap.add_argument("--model", default=DEFAULT_MODELS, help="comma list: known names (random weights) or folders")
    ap.add_argument("--files", type=int, default=8, help="long files, decoded together")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each file")
    ap.add_argument("--max-files", type=int, default=None, help="decode only the first N of the files")
    ap.add_argument("--peers", default="enc2dec,hf", help="enc2dec, hf or both")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU) or float32 (default on a CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--language", default="en", help="given to both peers on multilingual checkpoints")
    ap.add_argument("--work-dir", default="/tmp/longform_rtf", help="where random models are saved")
    ap.add_argument("--keep-models", action="store_true", help="keep the saved random models afterwards")
    a = ap.parse_args(argv)

    import torch

    from enc2dec.engine.whisper.transcribe import MAX_WINDOW_TOKENS

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype_name]
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    files, refs = compose(Path(os.path.expanduser(a.speech_dir)), a.files, a.minutes)
    files, refs = files[:a.max_files], refs[:a.max_files]
    work_dir = Path(a.work_dir)
    print(f"{len(files)} files x {a.minutes:g} min ({sum(map(len, files)) / SR:.0f} s of audio), {device}, "
          f"{dtype_name}, torch {torch.__version__}", flush=True)
    rows = []
    for model in [m.strip() for m in a.model.split(",") if m.strip()]:
        print(f"{model}:", flush=True)
        folder, is_random = model_folder(model, work_dir, dtype, device)
        runs = {}
        if "enc2dec" in peers:
            runs["enc2dec"] = run_enc2dec(folder, files, dtype_name, device, a.language)
            _free(device)
        if "hf" in peers:
            runs["hf"] = run_pipeline(folder, files, dtype, device, a.language, MAX_WINDOW_TOKENS)
            _free(device)
        for r in runs.values():
            per_window = r.num_tokens / max(1, r.num_windows)
            if not is_random:       # a real checkpoint: its words can be scored
                r.note += f", WER {word_error_rate(folder, refs, list(r.texts)):.2%}"
            print(f"  {r.peer:<22} RTF {r.rtf:8.1f}  wall {r.wall_s:7.1f} s  windows {r.num_windows:4d}  "
                  f"tokens/window {per_window:6.1f}  ({r.note})", flush=True)
        if len(runs) == 2:
            print(f"  enc2dec / pipeline RTF: {runs['enc2dec'].rtf / runs['hf'].rtf:.2f}x", flush=True)
        rows.append((model, is_random, runs))
        if is_random and not a.keep_models:
            shutil.rmtree(folder, ignore_errors=True)
    print("\nmodel | weights | peer | RTF | wall s | windows | tokens/window | note")
    for model, is_random, runs in rows:
        for r in runs.values():
            print(f"{model} | {'random' if is_random else 'checkpoint'} | {r.peer} | {r.rtf:.1f} | {r.wall_s:.1f} | "
                  f"{r.num_windows} | {r.num_tokens / max(1, r.num_windows):.1f} | {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
