"""Per-request timings in, one flat record of metrics per (backend, concurrency level) out.

Definitions (docs/bench.md restates them for users). All times are one monotonic clock
of the bench process, in seconds here and milliseconds in the record.
- TTFT: request sent -> its first output token available to the client.
- E2E: request sent -> its last output available.
- TPOT: per request (E2E - TTFT) / (output tokens - 1), requests with >= 2 tokens.
- ITL: gaps between consecutive output arrivals, pooled over all requests.
- Throughputs divide by the level's duration: first request sent -> last one done.
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

LATENCIES = ("ttft", "tpot", "itl", "e2e")
API_PHASE_NAMES = ("to_engine", "first_hop", "first_send", "finish_hop")
STATS = ("mean", "p50", "p90", "p99")


@dataclass
class RequestRecord:
    start_s: float                                    # the client sent it
    end_s: float = 0.0                                # its last output arrived
    token_times_s: list[float] = field(default_factory=list)   # arrival of each output step, first included
    input_len: int = 0
    output_len: int = 0
    audio_s: float = 0.0
    error: str | None = None
    num_preemptions: int = 0
    kind: str = "plain"                               # the request's BenchRequest.kind
    headers_s: float | None = None                    # --url: the response's headers arrived

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        ttft = self.ttft_s
        if ttft is None or self.output_len < 2:
            return None
        return max(0.0, self.e2e_s - ttft) / (self.output_len - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; values need not be sorted."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {stat: None for stat in STATS}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}


@dataclass
class LevelMetrics:
    """One row of the report: a backend at one concurrency level. ``to_dict`` is the JSON record."""

    backend: str                       # "enc2dec", "http", "hf", "hf-compile"
    concurrency: int
    num_requests: int                  # sent and measured (warm-up excluded)
    completed: int
    failed: int
    duration_s: float
    req_per_s: float
    input_tokens: int
    output_tokens: int
    out_tok_per_s: float
    total_tok_per_s: float
    latency_ms: dict[str, dict[str, float | None]]    # {"ttft": {"mean", "p50", "p90", "p99"}, ...}
    audio_s: float = 0.0
    rtf: float | None = None           # audio seconds per wall second (higher is faster)
    peak_gpu_mem_gib: float | None = None
    kv_self_blocks_peak: int | None = None
    kv_self_blocks_total: int | None = None
    kv_cross_blocks_peak: int | None = None
    kv_cross_blocks_total: int | None = None
    num_preemptions: int = 0
    # The engine's step loop over the level (``step_extras``), where the target reports it
    engine_steps: int | None = None
    engine_step_ms: float | None = None              # mean time per step
    engine_rows_per_step: float | None = None        # mean decoder rows per step
    engine_device_wait_frac: float | None = None     # share of step time spent waiting for the device
    # Mean times of the level's finished requests inside the engine (arrival = admission into the
    # engine): against mean_ttft_ms / mean_e2e_ms, the time outside it (HTTP, API processes, client)
    engine_ttft_ms: float | None = None
    engine_e2e_ms: float | None = None
    # enc2dec serve's phases of a stream outside the engine, mean ms (serve/metrics.py API_PHASES):
    # receipt to engine arrival, engine first token to the API process, to its first event sent,
    # engine finish to the API process's last output
    api_to_engine_ms: float | None = None
    api_first_hop_ms: float | None = None
    api_first_send_ms: float | None = None
    api_finish_hop_ms: float | None = None
    api_loop_lag_ms: float | None = None             # how late serve's API event loops ran a 10 ms timer, mean
    client_headers_ms: float | None = None           # --url: mean time from send to the response's headers
    # --url with client processes: the busiest one's CPU share and the client loops' lag running a
    # 1 ms timer, mean and p99 (bench/http_shards.py): a busy client delays its own readings
    client_cpu_frac: float | None = None
    client_lag_ms: float | None = None
    client_lag_p99_ms: float | None = None
    errors: list[str] = field(default_factory=list)  # the first few distinct failure messages
    # Levels mixing request kinds (``--timestamps-every``): each kind's share, and the plain one's
    plain_out_tok_per_s: float | None = None
    groups: dict[str, dict] | None = None

    def get(self, key: str):
        """A flat metric by name: ``out_tok_per_s``, ``p99_e2e_ms``, ``mean_ttft_ms``, ..."""
        stat, _, rest = key.partition("_")
        if stat in STATS and rest.endswith("_ms") and rest[:-3] in LATENCIES:
            return self.latency_ms[rest[:-3]][stat]
        return getattr(self, key)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["latency_ms"]
        for name, stats in self.latency_ms.items():
            for stat, value in stats.items():
                d[f"{stat}_{name}_ms"] = value
        return d


def metric_names() -> list[str]:
    """Every numeric metric a ``--fail-under`` threshold may name."""
    flat = [f"{s}_{m}_ms" for m in LATENCIES for s in STATS]
    return ["completed", "failed", "duration_s", "req_per_s", "out_tok_per_s", "total_tok_per_s",
            "input_tokens", "output_tokens", *flat, "audio_s", "rtf", "peak_gpu_mem_gib",
            "kv_self_blocks_peak", "kv_cross_blocks_peak", "num_preemptions", "plain_out_tok_per_s",
            "engine_steps", "engine_step_ms", "engine_rows_per_step", "engine_device_wait_frac",
            "engine_ttft_ms", "engine_e2e_ms", *(f"api_{p}_ms" for p in API_PHASE_NAMES),
            "api_loop_lag_ms", "client_headers_ms", "client_cpu_frac", "client_lag_ms", "client_lag_p99_ms"]


def step_extras(before: dict | None, after: dict | None) -> dict:
    """A level's engine step figures from the step counters (``EngineCore.StepCounters``) read
    before and after it; nothing where the target gave none or no step ran."""
    if not before or not after:
        return {}
    d = {key: after[key] - before[key] for key in ("num_steps", "num_rows", "step_s", "device_wait_s")
         if key in after and key in before}
    steps = d.get("num_steps", 0)
    if len(d) < 4 or steps <= 0:
        return {}
    out = {"engine_steps": int(steps), "engine_step_ms": 1000.0 * d["step_s"] / steps,
           "engine_rows_per_step": d["num_rows"] / steps,
           "engine_device_wait_frac": d["device_wait_s"] / d["step_s"] if d["step_s"] > 0 else None}
    if all(k in before and k in after for k in ("num_finished", "first_token_s", "finish_s")):
        done = after["num_finished"] - before["num_finished"]
        if done > 0:
            out["engine_ttft_ms"] = 1000.0 * (after["first_token_s"] - before["first_token_s"]) / done
            out["engine_e2e_ms"] = 1000.0 * (after["finish_s"] - before["finish_s"]) / done
    ticks = after.get("api_loop_ticks", 0) - before.get("api_loop_ticks", 0)
    if ticks > 0 and "api_loop_lag_s" in before and "api_loop_lag_s" in after:
        out["api_loop_lag_ms"] = 1000.0 * (after["api_loop_lag_s"] - before["api_loop_lag_s"]) / ticks
    streams = after.get("api_streams", 0) - before.get("api_streams", 0)
    if streams > 0:
        for p in API_PHASE_NAMES:
            key = f"api_{p}_s"
            if key in before and key in after:
                out[f"api_{p}_ms"] = 1000.0 * (after[key] - before[key]) / streams
    return out


def _groups(ok: list[RequestRecord], duration_s: float) -> dict[str, dict] | None:
    """Per request kind, when a level holds more than one: its completed requests, its output
    tokens over the level's duration (the kinds' figures add up to the level's), its latencies."""
    kinds = sorted({r.kind for r in ok})
    if len(kinds) < 2:
        return None
    out = {}
    for kind in kinds:
        mine = [r for r in ok if r.kind == kind]
        tokens = sum(r.output_len for r in mine)
        out[kind] = {"completed": len(mine), "output_tokens": tokens, "out_tok_per_s": tokens / duration_s,
                     "mean_tpot_ms": summarize_ms([t for r in mine if (t := r.tpot_s) is not None])["mean"],
                     "p50_e2e_ms": summarize_ms([r.e2e_s for r in mine])["p50"]}
    return out


def compute_level(backend: str, concurrency: int, records: list[RequestRecord], duration_s: float,
                  **extra) -> LevelMetrics:
    ok = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    in_tok = sum(r.input_len for r in ok)
    out_tok = sum(r.output_len for r in ok)
    audio_s = sum(r.audio_s for r in ok)
    latency = {
        "ttft": summarize_ms([t for r in ok if (t := r.ttft_s) is not None]),
        "tpot": summarize_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl": summarize_ms([g for r in ok for g in r.itls_s]),
        "e2e": summarize_ms([r.e2e_s for r in ok]),
    }
    errors = list(dict.fromkeys(r.error for r in records if not r.ok))[:5]
    groups = _groups(ok, duration_s)
    headers = [r.headers_s - r.start_s for r in ok if r.headers_s is not None]
    if headers:
        extra["client_headers_ms"] = 1000.0 * sum(headers) / len(headers)
    return LevelMetrics(
        backend=backend, concurrency=concurrency, num_requests=len(records), completed=len(ok),
        failed=len(records) - len(ok), duration_s=duration_s, req_per_s=len(ok) / duration_s,
        input_tokens=in_tok, output_tokens=out_tok, out_tok_per_s=out_tok / duration_s,
        total_tok_per_s=(in_tok + out_tok) / duration_s, latency_ms=latency, audio_s=audio_s,
        rtf=audio_s / duration_s if audio_s > 0 else None,
        num_preemptions=sum(r.num_preemptions for r in records), errors=errors, groups=groups,
        plain_out_tok_per_s=groups["plain"]["out_tok_per_s"] if groups and "plain" in groups else None, **extra)
