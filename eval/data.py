"""Rows in: a local JSONL / JSON / CSV / Parquet file, an audio manifest, or a Hugging Face
dataset (hub id with config and split, or a local folder; needs ``datasets``).

A row that cannot be used (a missing field, empty text, unreadable audio) becomes a
``BadRow`` with a kind and a detail; the run goes on, and only a run where every row is
bad is an input error. ``--limit N`` keeps the first N rows, bad ones included.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .audio import AudioError, load_clip
from .errors import EvalInputError
from .tasks import TaskSpec

_LOCAL_FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


@dataclass
class Example:
    row: int                       # 0-based position in the data (after --limit)
    source: str | np.ndarray       # prompt text (the session adds --prefix), or a 16 kHz mono wave
    reference: str
    label: str                     # what the per-row outputs call it: an audio file or the text's start

    @property
    def audio_s(self) -> float:
        return 0.0 if isinstance(self.source, str) else len(self.source) / 16000


@dataclass
class BadRow:
    row: int
    kind: str                      # "missing field", "empty text", "unreadable audio", ...
    detail: str


@dataclass
class DataSpec:
    data: str | None
    config: str | None = None
    split: str | None = None
    source_field: str | None = None
    target_field: str | None = None
    limit: int | None = None


@dataclass
class LoadedData:
    description: str
    examples: list[Example]
    bad_rows: list[BadRow]
    num_rows: int
    first_row_fields: list[str] = field(default_factory=list)
    source_field: str = ""
    target_field: str = ""


# ---- raw rows ------------------------------------------------------------------------------

def _jsonl_rows(path: str) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            yield from json.loads(text)
            return
        except json.JSONDecodeError as e:
            raise EvalInputError(f"{path} is not valid JSON: {e}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            yield BadRow(-1, "not JSON", f"line {number}: {e.msg}")


def _csv_rows(path: str) -> Iterator[Any]:
    with open(path, newline="", encoding="utf-8") as f:
        yield from csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ",")


def _parquet_rows(path: str) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EvalInputError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - arrow's error types vary by cause
        raise EvalInputError(f"cannot read {path} as Parquet: {e}") from None
    yield from table.to_pylist()


def _hf_rows(path: str, config: str | None, split: str, limit: int | None, audio_field: str | None):
    where = f"{path}" + (f" (config {config})" if config else "") + f", split {split}"
    try:
        import datasets
    except ImportError:
        raise EvalInputError(f"reading the Hugging Face dataset {where} needs the 'datasets' package (pip "
                             "install datasets); or pass a local JSONL / CSV / Parquet file with --data") from None
    try:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in
                                       ("dataset_dict.json", "state.json", "dataset_info.json")):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise EvalInputError(f"{path} has no split {split!r}; splits: {', '.join(ds)} (use --split)")
                ds = ds[split]
        else:
            # With --limit, stream: only the first rows are downloaded.
            ds = datasets.load_dataset(path, config, split=split, streaming=limit is not None)
        features = getattr(ds, "features", None) or {}
        if audio_field in features and isinstance(features[audio_field], datasets.Audio):
            ds = ds.cast_column(audio_field, datasets.Audio(decode=False))   # we decode, no torchcodec needed
        rows = ds.take(limit) if limit is not None and hasattr(ds, "take") else ds
        return iter(rows), where
    except EvalInputError:
        raise
    except Exception as e:  # noqa: BLE001 - hub, cache and format errors are many
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvalInputError(f"cannot load the dataset {where}: {first}") from None


def _raw_rows(spec: DataSpec, task: TaskSpec, source_field: str) -> tuple[Iterable[Any], str, str]:
    """(rows, folder that relative audio paths start from, description)."""
    path = spec.data
    if os.path.isfile(path):
        lower = path.lower()
        if lower.endswith((".jsonl", ".json")):
            rows = _jsonl_rows(path)
        elif lower.endswith((".csv", ".tsv")):
            rows = _csv_rows(path)
        elif lower.endswith(".parquet"):
            rows = _parquet_rows(path)
        else:
            raise EvalInputError(f"--data {path}: unknown file type; use one of {', '.join(_LOCAL_FORMATS)}, "
                                 "a dataset folder or a hub id")
        return rows, os.path.dirname(os.path.abspath(path)), path
    if os.path.exists(path) and not os.path.isdir(path):
        raise EvalInputError(f"--data {path} is neither a file nor a folder")
    if not os.path.isdir(path) and os.path.splitext(path)[1].lower() in _LOCAL_FORMATS:
        raise EvalInputError(f"--data {path}: no such file")
    rows, where = _hf_rows(path, spec.config, spec.split or "test", spec.limit,
                           source_field if task.is_audio else None)
    return rows, path if os.path.isdir(path) else ".", where


# ---- rows -> examples ----------------------------------------------------------------------

_MISSING = object()


def _field(row: dict, name: str):
    """A field by name, or a dotted path into nested mappings (``translation.de``)."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _text(row: dict, name: str, what: str) -> str | BadRow:
    value = _field(row, name)
    if value is _MISSING or value is None:
        return BadRow(-1, "missing field", f"no {what} field {name!r}")
    if not isinstance(value, str):
        return BadRow(-1, "not text", f"{what} field {name!r} holds {type(value).__name__}, not text")
    if not value.strip():
        return BadRow(-1, "empty text", f"{what} field {name!r} is empty")
    return value


def _example(index: int, row: Any, spec: DataSpec, task: TaskSpec, base_dir: str) -> Example | BadRow:
    if isinstance(row, BadRow):
        return row
    if not isinstance(row, dict):
        return BadRow(index, "not an object", f"the row is a {type(row).__name__}, not an object with fields")
    reference = _text(row, spec.target_field, "reference")
    if isinstance(reference, BadRow):
        return reference
    if task.is_audio:
        value = _field(row, spec.source_field)
        if value is _MISSING or value is None:
            return BadRow(index, "missing field", f"no audio field {spec.source_field!r}")
        try:
            wave = load_clip(value, base_dir)
        except AudioError as e:
            return BadRow(index, e.kind, str(e))
        label = value if isinstance(value, str) else (value.get("path") if isinstance(value, dict) else None)
        return Example(index, wave, reference.strip(), os.path.basename(label) if label else f"row {index}")
    source = _text(row, spec.source_field, "source")
    if isinstance(source, BadRow):
        return source
    return Example(index, source, reference.strip(), source[:60])


def load_examples(spec: DataSpec, task: TaskSpec) -> LoadedData:
    default = task.default_data
    if spec.data is None:
        if default is None:
            raise EvalInputError(f"--task {task.name} has no default dataset; pass --data (a JSONL manifest "
                                 f'of {{"audio": file, "text": reference}} lines, or a dataset)')
        spec = DataSpec(default.path, spec.config or default.config, spec.split or default.split,
                        spec.source_field or default.source_field, spec.target_field or default.target_field,
                        spec.limit)
    spec = DataSpec(spec.data, spec.config, spec.split, spec.source_field or task.source_field,
                    spec.target_field or task.target_field, spec.limit)
    rows, base_dir, where = _raw_rows(spec, task, spec.source_field)
    examples, bad, first_fields, n = [], [], [], 0
    try:
        for n, row in enumerate(rows, 1):
            if spec.limit is not None and n > spec.limit:
                n -= 1
                break
            if not first_fields and isinstance(row, dict):
                first_fields = list(row)
            item = _example(n - 1, row, spec, task, base_dir)
            if isinstance(item, BadRow):
                item.row = n - 1
                bad.append(item)
            else:
                examples.append(item)
    except EvalInputError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable files, bad encodings, a dataset's lazy decoding
        raise EvalInputError(f"reading {where} failed after {n} rows: {type(e).__name__}: {e}") from None
    if n == 0:
        raise EvalInputError(f"--data {where} holds no rows")
    return LoadedData(where, examples, bad, n, first_fields, spec.source_field, spec.target_field)


def summarize_bad(bad: list[BadRow]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for b in bad:
        counts[b.kind] = counts.get(b.kind, 0) + 1
    return counts


def all_bad_error(data: LoadedData, bad: list[BadRow], source_flag: str = "--source-field") -> EvalInputError:
    kinds = ", ".join(f"{k}: {v}" for k, v in summarize_bad(bad).items())
    first = bad[0]
    hint = ""
    if first.kind == "missing field" and data.first_row_fields:
        hint = (f" The first row's fields are {', '.join(map(str, data.first_row_fields))}; "
                f"choose with {source_flag} / --target-field.")
    return EvalInputError(f"all {len(bad)} rows of {data.description} are bad ({kinds}); row {first.row}: "
                          f"{first.detail}.{hint}")
