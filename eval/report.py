"""What an eval leaves behind: the JSON report (schema ``enc2dec.eval/v1``, documented in
docs/eval.md), per-row outputs, the Rich summary table, and the progress display."""
from __future__ import annotations

import dataclasses
import json
import os
import platform

from .data import summarize_bad
from .errors import EvalInputError
from .tasks import METRIC_LABELS

SCHEMA = "enc2dec.eval/v1"
_MAX_LISTED = 20      # bad rows, mismatches and failures listed one by one in the report


class NullProgress:
    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def stop(self) -> None:
        pass


class RichProgress(NullProgress):
    """One bar per generator (enc2dec, then transformers), on stderr."""

    def __init__(self):
        self._progress = None
        self._task = None

    def start(self, label: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=Console(stderr=True))
        self._progress.start()
        self._task = self._progress.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if n and self._progress is not None:
            self._progress.advance(self._task, n)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("enc2dec", "torch", "transformers", "sacrebleu", "rouge-score", "jiwer", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPU cores)"


def build_report(*, opts, args, data, bad, rows, device, dtype, attn_backend, decoding, normalizer, ours, hf, metric_notes,
                 parity, engine_wall_s, hf_wall_s, checks, failures, exit_code) -> dict:
    ours_tokens = sum(len(r.ours) for r in rows)
    hf_tokens = sum(len(r.hf) for r in rows) if hf is not None else None
    audio_s = sum(r.example.audio_s for r in rows)
    mismatched = [r for r in rows if r.hf is not None and r.hf != r.ours]
    bad = sorted(bad, key=lambda b: b.row)
    return {
        "schema": SCHEMA,
        "command": opts.command,
        "task": opts.task,
        "model": opts.model,
        "versions": _versions(),
        "engine": {"device": str(device), "device_name": _device_name(device),
                   "dtype": str(dtype).replace("torch.", ""), "max_batch_size": args.max_batch_size,
                   "attn_backend": attn_backend, "load_format": args.load_format, "config": opts.config,
                   "tuning": dataclasses.asdict(args.tuning)},
        "data": {"source": data.description, "source_field": data.source_field,
                 "target_field": data.target_field, "limit": opts.data.limit, "num_rows": data.num_rows,
                 "num_used": len(rows), "num_bad": len(bad), "bad_by_kind": summarize_bad(bad),
                 "bad_rows": [{"row": b.row, "kind": b.kind, "detail": b.detail} for b in bad[:_MAX_LISTED]],
                 "language": opts.language},
        "decoding": decoding,
        "reference": opts.reference,
        "hf_batch_size": opts.batch_size if hf is not None else None,
        "normalizer": normalizer,
        "metrics": {"enc2dec": ours, "hf": hf},
        "metric_notes": metric_notes,
        "parity": parity,
        "timing": {
            "enc2dec_s": engine_wall_s, "hf_s": hf_wall_s,
            "speedup": hf_wall_s / engine_wall_s if hf_wall_s and engine_wall_s else None,
            "enc2dec_out_tokens": ours_tokens, "hf_out_tokens": hf_tokens,
            "enc2dec_out_tok_per_s": ours_tokens / engine_wall_s if engine_wall_s else None,
            "hf_out_tok_per_s": hf_tokens / hf_wall_s if hf_wall_s else None,
            "audio_s": audio_s or None,
        },
        "engine_failures": {"num": len(failures), "rows": [{"row": r.example.row, "error": r.error}
                                                           for r in failures[:_MAX_LISTED]]},
        "mismatches": [{"row": r.example.row, "label": r.example.label,
                        "first_diff": _first_diff(r.ours, r.hf), "enc2dec": r.ours_text.strip(),
                        "hf": (r.hf_text or "").strip()} for r in mismatched[:_MAX_LISTED]],
        "checks": [vars(c) for c in checks],
        "exit_code": exit_code,
    }


def _first_diff(a, b):
    from .parity import first_difference

    return first_difference(a, b)


def write_json(path: str, report: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise EvalInputError(f"cannot write the report to {path}: {e}") from None


def write_outputs(path: str, rows) -> None:
    """One JSON object per evaluated row: reference, both outputs, token ids, agreement."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                record = {"row": r.example.row, "label": r.example.label, "reference": r.example.reference,
                          "enc2dec": r.ours_text.strip(), "enc2dec_token_ids": r.ours,
                          "finish_reason": r.finish_reason, "error": r.error}
                if r.hf is not None:
                    record.update(hf=(r.hf_text or "").strip(), hf_token_ids=r.hf, match=r.hf == r.ours,
                                  first_diff=_first_diff(r.ours, r.hf), hf_rerun_alone=r.rechecked)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    except OSError as e:
        raise EvalInputError(f"cannot write the outputs to {path}: {e}") from None


# ---- the summary table ---------------------------------------------------------------------------

def _fmt(figure: str, value) -> str:
    if value is None:
        return "-"
    if figure in ("wer", "cer", "exact_match", "text_exact_match"):
        return f"{100 * value:.2f} %"
    return f"{value:.2f}"


def print_summary(report: dict, console) -> None:
    from rich.table import Table

    has_hf = report["metrics"]["hf"] is not None
    eng = report["engine"]
    t = Table(title=f"enc2dec eval --task {report['task']}: {report['model']} ({eng['dtype']}, "
                    f"{eng['device_name']})", title_justify="left")
    t.add_column("figure")
    t.add_column("enc2dec", justify="right")
    if has_hf:
        t.add_column("transformers", justify="right")
    for figure, value in report["metrics"]["enc2dec"].items():
        t.add_row(METRIC_LABELS.get(figure, figure), _fmt(figure, value),
                  *([_fmt(figure, report["metrics"]["hf"][figure])] if has_hf else []))
    tm = report["timing"]
    t.add_row("wall clock", f"{tm['enc2dec_s']:.2f} s", *([f"{tm['hf_s']:.2f} s"] if has_hf else []))
    t.add_row("output tokens/s", f"{tm['enc2dec_out_tok_per_s']:.1f}",
              *([f"{tm['hf_out_tok_per_s']:.1f}"] if has_hf else []))
    p = report["parity"]
    if p is not None:
        t.add_section()
        t.add_row("exact match (token ids)", f"{_fmt('exact_match', p['exact_match'])} "
                                             f"({p['num_exact']}/{p['num_compared']})")
        t.add_row("exact match (text)", _fmt("text_exact_match", p["text_exact_match"]))
        if p["num_mismatched"]:
            t.add_row("first difference at", f"mean {p['first_diff_mean']:.1f}, min {p['first_diff_min']}")
        t.add_row("speedup", f"{tm['speedup']:.2f}x" if tm["speedup"] else "-")
    console.print(t)
    d = report["data"]
    bad = ", ".join(f"{k}: {v}" for k, v in d["bad_by_kind"].items())
    batches = f"; engine max_batch_size {eng['max_batch_size']}" + (
        f", transformers batch {report['hf_batch_size']}" if has_hf else "")
    console.print(f"rows: {d['num_used']} used, {d['num_bad']} bad" + (f" ({bad})" if bad else "") + batches)
    for b in d["bad_rows"][:3]:
        console.print(f"  bad row {b['row']}: {b['detail']}")
    if report["normalizer"]:
        console.print(f"normalizer: {report['normalizer']}")
    for note in report["decoding"]["notes"]:
        console.print(f"note: {note}")
