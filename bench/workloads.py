"""Bench workloads: the list of requests every backend (engine, HTTP, HF baseline) replays.

A request is its encoder input (token ids, a text prompt, or audio for Whisper) and the exact
number of decoder tokens to produce: every backend forces that length (``ignore_eos`` /
``min_new_tokens``), so the same workload does the same work everywhere.

Sources: synthetic lengths (fixed, normal or uniform, seeded), a JSONL file in
trtllm-bench's shape, a Hugging Face dataset, and audio (see ``audio.py``).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from .errors import BenchInputError

DISTRIBUTIONS = ("fixed", "normal", "uniform")


@dataclass(frozen=True)
class BenchRequest:
    prompt: Any            # encoder token ids | text | Whisper {"prompt": "", "multi_modal_data": ...}
    input_len: int         # encoder tokens; 0 when not known before tokenizing (text) or for audio
    output_len: int        # decoder tokens to produce, exactly
    audio_s: float = 0.0   # seconds of audio (Whisper requests)
    source: str = ""       # where it came from, for error messages: "data.jsonl line 3"
    sampling: dict = field(default_factory=dict, hash=False)   # SamplingParams keywords ({}: greedy)
    kind: str = "plain"    # Whisper decoding rules it runs ("timestamps", ...); reports split mixed levels by it

    @property
    def is_audio(self) -> bool:
        return isinstance(self.prompt, dict) and "multi_modal_data" in self.prompt

    @property
    def is_text(self) -> bool:
        return isinstance(self.prompt, str)


@dataclass(frozen=True)
class LengthDist:
    """``fixed``, ``normal[:stdev]`` or ``uniform[:half_width]`` around a mean, in tokens."""

    kind: str
    mean: int
    spread: float

    @staticmethod
    def parse(spec: str, mean: int, option: str) -> "LengthDist":
        if not isinstance(mean, int) or mean < 1:
            raise BenchInputError(f"{option.replace('dist', 'len')} must be an integer >= 1, got {mean!r}")
        kind, _, arg = str(spec).strip().partition(":")
        if kind not in DISTRIBUTIONS:
            raise BenchInputError(f"{option}={spec!r} is not valid; use fixed, normal[:STDEV] or "
                                  f"uniform[:HALF_WIDTH] (e.g. normal:16)")
        spread = mean / 4
        if arg:
            try:
                spread = float(arg)
            except ValueError:
                spread = -1.0
            if spread < 0 or kind == "fixed":
                raise BenchInputError(f"{option}={spec!r}: the part after ':' must be a number >= 0 "
                                      f"(stdev for normal, half width for uniform; fixed takes none)")
        return LengthDist(kind, mean, 0.0 if kind == "fixed" else spread)

    def sample(self, n: int, rng: random.Random, max_len: int | None = None) -> list[int]:
        if self.kind == "fixed":
            values = [self.mean] * n
        elif self.kind == "normal":
            values = [round(rng.gauss(self.mean, self.spread)) for _ in range(n)]
        else:
            values = [round(rng.uniform(self.mean - self.spread, self.mean + self.spread)) for _ in range(n)]
        hi = max_len if max_len is not None else max(values, default=1)
        return [min(max(1, v), hi) for v in values]


def token_id_range(vocab_size: int | None) -> tuple[int, int]:
    """Ids safe to send as random text: above the special tokens, below the vocabulary's end
    (T5's sentinel ids start at 32000). Without a known vocabulary, a range every usual one has."""
    if not vocab_size:
        return 100, 30000
    return min(100, vocab_size // 8), min(vocab_size, 32000)


def synthetic_requests(num: int, input_dist: LengthDist, output_dist: LengthDist, seed: int,
                       vocab_size: int | None = None) -> list[BenchRequest]:
    """``num`` requests of random token ids, lengths drawn from the two distributions."""
    rng_len, rng_ids = random.Random(seed), random.Random(seed + 1)
    in_lens = input_dist.sample(num, rng_len)
    out_lens = output_dist.sample(num, rng_len)
    lo, hi = token_id_range(vocab_size)
    return [BenchRequest([rng_ids.randrange(lo, hi) for _ in range(n_in)], n_in, n_out, source=f"synthetic #{i}")
            for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))]


def _positive_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchInputError(f"{where}: {what} must be an integer >= 1, got {value!r}")
    return value


def request_from_row(row: Any, where: str, default_output_len: int, prompt_key: str = "prompt",
                     ids_key: str = "input_ids", output_key: str = "output_tokens") -> BenchRequest:
    """One trtllm-bench-shaped row: ``input_ids`` (list of ints) or ``prompt`` (text), and
    ``output_tokens`` (else ``default_output_len``)."""
    if not isinstance(row, dict):
        raise BenchInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    out_len = default_output_len if row.get(output_key) is None else _positive_int(
        row[output_key], f"'{output_key}'", where)
    ids = row.get(ids_key)
    if ids is not None:
        if (not isinstance(ids, list) or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
            raise BenchInputError(f"{where}: '{ids_key}' must be a non-empty list of token ids (integers >= 0)")
        return BenchRequest(list(ids), len(ids), out_len, source=where)
    text = row.get(prompt_key)
    if isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        return BenchRequest(list(text), len(text), out_len, source=where)
    if not isinstance(text, str) or not text:
        raise BenchInputError(f"{where}: needs '{ids_key}' (token ids) or '{prompt_key}' (non-empty text); "
                              f"keys present: {', '.join(sorted(map(str, row))) or 'none'}")
    return BenchRequest(text, 0, out_len, source=where)


def iter_jsonl(path: str, what: str):
    """``(where, row)`` for each non-blank line of a JSONL file; a bad line names its number."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise BenchInputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchInputError(f"{where}: not valid JSON ({e.msg})") from None


def load_jsonl(path: str, default_output_len: int, limit: int | None = None) -> list[BenchRequest]:
    """trtllm-bench's dataset shape, one JSON object a line; a bad line names its number."""
    requests = []
    for where, row in iter_jsonl(path, "dataset"):
        requests.append(request_from_row(row, where, default_output_len))
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise BenchInputError(f"dataset {path} holds no requests")
    return requests


@dataclass(frozen=True)
class HfDatasetSpec:
    name: str                          # hub id or local path (a folder saved with save_to_disk, or data files)
    split: str = "train"
    subset: str | None = None
    prompt_field: str = "prompt"       # text, or a list of token ids
    output_len_field: str | None = None
    audio_field: str | None = None     # {"array", "sampling_rate"} rows (Whisper)


def _load_hf(spec: HfDatasetSpec):
    try:
        import datasets
    except ImportError:
        raise BenchInputError("--hf-dataset needs the 'datasets' package: pip install datasets") from None
    try:
        if os.path.isdir(spec.name) and os.path.exists(os.path.join(spec.name, "dataset_dict.json")):
            return datasets.load_from_disk(spec.name)[spec.split]
        if os.path.isdir(spec.name) and os.path.exists(os.path.join(spec.name, "state.json")):
            return datasets.load_from_disk(spec.name)
        return datasets.load_dataset(spec.name, spec.subset, split=spec.split)
    except Exception as e:  # noqa: BLE001 - hub, file and schema errors come in many types
        raise BenchInputError(f"cannot load Hugging Face dataset {spec.name!r} (split {spec.split!r}): "
                              f"{type(e).__name__}: {e}") from None


def load_hf_dataset(spec: HfDatasetSpec, default_output_len: int, limit: int) -> list[BenchRequest]:
    ds = _load_hf(spec)
    columns = set(getattr(ds, "column_names", None) or [])
    for option, field_name in (("--hf-prompt-field", None if spec.audio_field else spec.prompt_field),
                               ("--hf-output-len-field", spec.output_len_field),
                               ("--hf-audio-field", spec.audio_field)):
        if field_name and columns and field_name not in columns:
            raise BenchInputError(f"{option}={field_name!r} is not a column of {spec.name}; "
                                  f"columns: {', '.join(sorted(columns))}")
    requests = []
    for i, row in enumerate(ds):
        if i >= limit:
            break
        where = f"{spec.name}[{spec.split}] row {i}"
        if spec.audio_field:
            from .audio import request_from_audio_item

            out_len = default_output_len
            if spec.output_len_field:
                out_len = _positive_int(row.get(spec.output_len_field), f"'{spec.output_len_field}'", where)
            requests.append(request_from_audio_item(row[spec.audio_field], out_len, where))
        else:
            requests.append(request_from_row(row, where, default_output_len, prompt_key=spec.prompt_field,
                                             ids_key="\0", output_key=spec.output_len_field or "\0"))
    if not requests:
        raise BenchInputError(f"Hugging Face dataset {spec.name!r} split {spec.split!r} is empty")
    return requests
