"""What a bench run leaves behind: Rich tables, the JSON report, CSV and the plot.

The JSON report (schema ``enc2dec.bench/v1``, documented in docs/bench.md) holds the exact
command, versions, device and workload, then one flat record per (backend, level) and the
ratio of the engine to each baseline per level.
"""
from __future__ import annotations

import csv
import json
import os

from rich.console import Console
from rich.table import Table

from .errors import BenchInputError
from .loop import Progress
from .metrics import API_PHASE_NAMES, LevelMetrics

SCHEMA = "enc2dec.bench/v1"
# (metric, higher is better): ratios are engine / baseline for throughputs and
# baseline / engine for latencies, so a ratio above 1 always means the engine is ahead.
RATIO_METRICS = (("req_per_s", True), ("out_tok_per_s", True), ("total_tok_per_s", True), ("rtf", True),
                 ("mean_ttft_ms", False), ("p99_ttft_ms", False), ("mean_tpot_ms", False),
                 ("p50_e2e_ms", False), ("p99_e2e_ms", False))


def ratios(levels: list[LevelMetrics], primary: str) -> list[dict]:
    by_key = {(lv.backend, lv.concurrency): lv for lv in levels}
    rows = []
    for lv in levels:
        if lv.backend == primary:
            continue
        ours = by_key.get((primary, lv.concurrency))
        if ours is None:
            continue
        row = {"concurrency": lv.concurrency, "baseline": lv.backend}
        for key, higher_better in RATIO_METRICS:
            a, b = ours.get(key), lv.get(key)
            if a is None or b is None or (b if higher_better else a) == 0:
                row[key] = None
            else:
                row[key] = a / b if higher_better else b / a
        rows.append(row)
    return rows


def _f(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def results_table(levels: list[LevelMetrics], title: str) -> Table:
    is_audio = any(lv.rtf is not None for lv in levels)
    has_kv = any(lv.kv_self_blocks_total for lv in levels)
    has_mem = any(lv.peak_gpu_mem_gib is not None for lv in levels)
    has_steps = any(lv.engine_steps for lv in levels)
    has_engine_times = any(lv.engine_e2e_ms is not None for lv in levels)
    has_api = any(lv.api_to_engine_ms is not None for lv in levels)
    has_client = any(lv.client_lag_ms is not None or lv.client_headers_ms is not None for lv in levels)
    t = Table(title=title, title_justify="left")
    cols = ["backend", "C", "ok/fail", "req/s", "out tok/s", "total tok/s", "TTFT mean/p99", "TPOT mean",
            "ITL p50/p99", "E2E p50/p99"]
    cols += ["RTF"] * is_audio + ["KV peak self/cross"] * has_kv + ["GPU GiB"] * has_mem
    cols += ["step ms / rows / wait"] * has_steps + ["in engine TTFT/E2E"] * has_engine_times
    cols += ["API in / 1st hop / send / last hop (loop lag)"] * has_api + ["client CPU / lag mean/p99 / headers"] * has_client
    for c in cols:
        t.add_column(c, justify="left" if c == "backend" else "right", no_wrap=True)
    for lv in levels:
        row = [lv.backend, str(lv.concurrency), f"{lv.completed}/{lv.failed}", _f(lv.req_per_s, 2),
               _f(lv.out_tok_per_s), _f(lv.total_tok_per_s), _pair(lv, "mean_ttft_ms", "p99_ttft_ms"),
               _f(lv.get("mean_tpot_ms")), _pair(lv, "p50_itl_ms", "p99_itl_ms"), _pair(lv, "p50_e2e_ms", "p99_e2e_ms")]
        if is_audio:
            row.append(_f(lv.rtf, 1))
        if has_kv:
            row.append(_kv_cell(lv))
        if has_mem:
            row.append(_f(lv.peak_gpu_mem_gib, 1))
        if has_steps:
            row.append(_step_cell(lv))
        if has_engine_times:
            row.append(f"{_f(lv.engine_ttft_ms)} / {_f(lv.engine_e2e_ms)}")
        if has_api:
            row.append(" / ".join(_f(getattr(lv, f"api_{p}_ms"), 2) for p in API_PHASE_NAMES)
                       + f" (loop lag {_f(lv.api_loop_lag_ms, 2)})")
        if has_client:
            cpu = "-" if lv.client_cpu_frac is None else f"{100.0 * lv.client_cpu_frac:.0f}%"
            row.append(f"{cpu} / {_f(lv.client_lag_ms, 2)} / {_f(lv.client_lag_p99_ms, 2)} / {_f(lv.client_headers_ms, 1)}")
        t.add_row(*row, style="red" if lv.failed else None)
    t.caption = "latencies in ms; definitions in docs/bench.md"
    return t


def _pair(lv: LevelMetrics, a: str, b: str) -> str:
    return f"{_f(lv.get(a))} / {_f(lv.get(b))}"


def _step_cell(lv: LevelMetrics) -> str:
    """Mean engine step time, decoder rows per step, and the share of step time spent waiting
    for the device."""
    if not lv.engine_steps:
        return "-"
    wait = "-" if lv.engine_device_wait_frac is None else f"{100.0 * lv.engine_device_wait_frac:.0f}%"
    return f"{_f(lv.engine_step_ms, 2)} / {_f(lv.engine_rows_per_step, 1)} / {wait}"


def _kv_cell(lv: LevelMetrics) -> str:
    if not lv.kv_self_blocks_total:
        return "-"
    s = 100.0 * (lv.kv_self_blocks_peak or 0) / lv.kv_self_blocks_total
    c = 100.0 * (lv.kv_cross_blocks_peak or 0) / max(1, lv.kv_cross_blocks_total or 0)
    return f"{s:.0f}% / {c:.0f}%"


def ratio_table(levels: list[LevelMetrics], primary: str) -> Table | None:
    rows = ratios(levels, primary)
    if not rows:
        return None
    by_key = {(lv.backend, lv.concurrency): lv for lv in levels}
    baselines = list(dict.fromkeys(r["baseline"] for r in rows))
    t = Table(title=f"{primary} vs baselines (x = how many times better {primary} is)", title_justify="left")
    t.add_column("C", justify="right", no_wrap=True)
    t.add_column(f"{primary} out tok/s", justify="right", no_wrap=True)
    for b in baselines:
        for c in (f"{b} out tok/s", f"x {b} tok/s", f"x {b} p99 E2E"):
            t.add_column(c, justify="right", no_wrap=True)
    for conc in sorted({r["concurrency"] for r in rows}):
        ours = by_key[(primary, conc)]
        cells = [str(conc), _f(ours.out_tok_per_s)]
        for b in baselines:
            base = by_key.get((b, conc))
            r = next((r for r in rows if r["concurrency"] == conc and r["baseline"] == b), {})
            cells += [_f(base.out_tok_per_s) if base else "-", _x(r.get("out_tok_per_s")), _x(r.get("p99_e2e_ms"))]
        t.add_row(*cells)
    return t


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def make_console(**kwargs) -> Console:
    """Wide when not a terminal (CI logs, pipes), where Rich would otherwise assume 80 columns."""
    console = Console(**kwargs)
    return console if console.is_terminal else Console(width=200, **kwargs)


def groups_table(levels: list[LevelMetrics]) -> Table | None:
    """Levels that mix request kinds (``--timestamps-every``): each kind on its own row."""
    mixed = [lv for lv in levels if lv.groups]
    if not mixed:
        return None
    t = Table(title="by request kind (out tok/s: the kind's tokens over the level's duration)", title_justify="left")
    for c in ("backend", "C", "kind", "completed", "out tok/s", "TPOT mean", "E2E p50"):
        t.add_column(c, justify="left" if c in ("backend", "kind") else "right", no_wrap=True)
    for lv in mixed:
        for kind, g in lv.groups.items():
            t.add_row(lv.backend, str(lv.concurrency), kind, str(g["completed"]), _f(g["out_tok_per_s"]),
                      _f(g["mean_tpot_ms"]), _f(g["p50_e2e_ms"]))
    return t


def print_tables(levels: list[LevelMetrics], primary: str, title: str, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(results_table(levels, title))
    for extra in (groups_table(levels), ratio_table(levels, primary)):
        if extra is not None:
            console.print(extra)


def report_dict(meta: dict, levels: list[LevelMetrics], primary: str) -> dict:
    return {"schema": SCHEMA, **meta, "levels": [lv.to_dict() for lv in levels],
            "ratios": ratios(levels, primary)}


def write_json(path: str, report: dict) -> None:
    _write(path, lambda f: json.dump(report, f, indent=2), "--report-json")


def write_csv(path: str, levels: list[LevelMetrics]) -> None:
    rows = [lv.to_dict() for lv in levels]
    for r in rows:
        r["errors"] = "; ".join(r["errors"])
        del r["groups"]       # nested; the JSON report holds it, plain_out_tok_per_s is its flat part

    def dump(f):
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["backend"])
        w.writeheader()
        w.writerows(rows)

    _write(path, dump, "--csv", newline="")


def _write(path: str, dump, option: str, newline: str | None = None) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline=newline) as f:
            dump(f)
    except OSError as e:
        raise BenchInputError(f"{option} {path}: cannot write: {e.strerror or e}") from None


def check_plot_available() -> None:
    """Asked before the run, so a missing extra fails fast rather than after minutes of benching."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchInputError("--plot needs matplotlib, which is not installed: "
                              "pip install 'enc2dec[plot]' (or pip install matplotlib)") from None


def write_plot(path: str, levels: list[LevelMetrics], title: str) -> None:
    """Output tokens/s against p50 end-to-end latency, one line per backend, points labelled C."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in dict.fromkeys(lv.backend for lv in levels):
        pts = sorted((lv for lv in levels if lv.backend == backend and lv.completed), key=lambda lv: lv.concurrency)
        xs, ys = [lv.get("p50_e2e_ms") or 0.0 for lv in pts], [lv.out_tok_per_s for lv in pts]
        ax.plot(xs, ys, marker="o", label=backend)
        for lv, x, y in zip(pts, xs, ys):
            ax.annotate(f"C={lv.concurrency}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("p50 end-to-end latency (ms)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise BenchInputError(f"--plot {path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


class RichProgress(Progress):
    """A progress bar per level (requests done of the level's total, or a counter with --duration)."""

    def __init__(self, console: Console | None = None):
        from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as _Bar

        self._bar = _Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)
        self._task = None

    def start(self, label: str, total: int | None) -> None:
        if self._task is None:
            self._bar.start()
        self._task = self._bar.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        self._bar.stop()
