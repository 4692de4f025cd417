"""Prometheus metrics, one registry per app (so several servers can live in one process).

Counters and histograms are updated as requests finish; queue depth, running requests and
KV blocks are read from the engine when /metrics is scraped, so they are never stale.

With several API processes (``PROMETHEUS_MULTIPROC_DIR`` set, see serve/server.py) each
process writes its counters to that folder and a scrape, whichever process answers it, sums
them (prometheus-client's multi-process mode); the requests in flight are then a gauge each
process refreshes on uvicorn's tick, summed over the live processes.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

# Seconds: CPU tests sit at the low end, 30 s Whisper windows on a busy GPU at the high end.
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


LOOP_TICK_S = 0.01
API_PHASES = {
    "to_engine": "Server receipt of a streamed request to its arrival in the engine, summed",
    "first_hop": "Engine first token to the API process having it, summed over streams",
    "first_send": "The API process having the first token to its event handed to the transport, summed",
    "finish_hop": "Engine finish to the API process having the last output, summed over streams",
}


class ServeMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict | None], num_in_flight: Callable[[], int]):
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

        disable_created_metrics()        # no *_created series: noise for every scraper we know

        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry(auto_describe=True)
        # Multi-process: the metrics live in the shared folder; a scrape reads them all from there.
        reg = None if self.multiprocess else self.registry
        self._in_flight_gauge = None
        if self.multiprocess:
            from prometheus_client import Gauge, multiprocess

            multiprocess.MultiProcessCollector(self.registry)
            self._in_flight_gauge = Gauge("enc2dec_num_requests_in_flight", "Engine requests the server has "
                                          "submitted and not yet answered", multiprocess_mode="livesum",
                                          registry=None)
            num_in_flight = None
        self.requests = Counter("enc2dec_http_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=reg)
        self.finished = Counter("enc2dec_request_finished", "Engine requests ended, by finish reason "
                                "(stop, length, abort = engine error, cancelled = client left)", ["reason"],
                                registry=reg)
        self.rejected_overload = Counter("enc2dec_request_rejected_overload",
                                         "Requests refused with 503 because the queue was full", registry=reg)
        self.prompt_tokens = Counter("enc2dec_prompt_tokens", "Encoder input tokens of finished requests",
                                     registry=reg)
        self.generation_tokens = Counter("enc2dec_generation_tokens", "Output tokens of finished requests",
                                         registry=reg)
        self.ttft = Histogram("enc2dec_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=TTFT_BUCKETS_S, registry=reg)
        self.e2e = Histogram("enc2dec_e2e_request_latency_seconds", "Arrival to last output token",
                             buckets=E2E_BUCKETS_S, registry=reg)
        # Where a streamed request's time goes outside the engine, summed over streams (bench --url
        # divides by the count): the server's receipt to the engine's arrival (body, validation,
        # tokenising, the hop to the engine), the engine's first token to this process having it,
        # to its first event handed to the transport, and the engine's finish to this process
        # having the last output. A client's TTFT less these and the engine's own: the client's part.
        self.api_streams = Counter("enc2dec_api_streams", "Streamed engine requests whose phases below were "
                                   "recorded", registry=reg)
        self.api_phases = {name: Counter(f"enc2dec_api_{name}_seconds", doc, registry=reg)
                           for name, doc in API_PHASES.items()}
        # How late this process's event loop runs a 10 ms timer: every stream's events and every new
        # request wait behind whatever the loop is doing, and no per-request phase shows that wait.
        self.loop_ticks = Counter("enc2dec_api_loop_ticks", "Ticks of the API event loop's 10 ms lag timer",
                                  registry=reg)
        self.loop_lag = Counter("enc2dec_api_loop_lag_seconds", "How late the API event loop ran its 10 ms timer, "
                                "summed over ticks", registry=reg)
        self.registry.register(_EngineCollector(model_name, engine_stats, num_in_flight))

    async def watch_loop(self, tick_s: float = LOOP_TICK_S) -> None:
        import asyncio

        while True:
            t = time.monotonic()
            await asyncio.sleep(tick_s)
            self.loop_ticks.inc()
            self.loop_lag.inc(max(0.0, time.monotonic() - t - tick_s))

    def observe_stream(self, received: float, out, first_out: float, first_sent: float, last_out: float) -> None:
        """One finished stream's phases (time.monotonic() seconds, the engine's clock too)."""
        m = out.metrics
        if not m.arrival_time or m.first_token_time is None or m.finished_time is None:
            return
        self.api_streams.inc()
        for name, value in (("to_engine", m.arrival_time - received), ("first_hop", first_out - m.first_token_time),
                            ("first_send", first_sent - first_out), ("finish_hop", last_out - m.finished_time)):
            self.api_phases[name].inc(max(0.0, value))

    def sync_in_flight(self, num: int) -> None:
        """Multi-process: this process's requests in flight, for the summed gauge."""
        if self._in_flight_gauge is not None:
            self._in_flight_gauge.set(num)

    def observe_output(self, out) -> None:
        """One finished RequestOutput (engine timestamps, so queueing time is included)."""
        m = out.metrics
        if out.error:
            self.finished.labels(reason="error").inc()
        else:
            for c in out.outputs:
                self.finished.labels(reason=c.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        if m.first_token_time is not None and m.arrival_time:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None and m.arrival_time:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges read at scrape time."""

    def __init__(self, model_name, engine_stats, num_in_flight):
        self._model, self._stats, self._in_flight = model_name, engine_stats, num_in_flight

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self._stats() or {}
        if self._in_flight is not None:          # else a multi-process gauge reports it
            yield _gauge(GaugeMetricFamily, "enc2dec_num_requests_in_flight",
                         "Engine requests the server has submitted and not yet answered", self._in_flight())
        if not stats:
            return
        yield _gauge(GaugeMetricFamily, "enc2dec_num_requests_waiting", "Requests queued in the engine "
                     "(not yet encoded)", stats["waiting"])
        yield _gauge(GaugeMetricFamily, "enc2dec_num_requests_running", "Requests decoding in the engine",
                     stats["running"])
        for kind, doc in (("used", "held by requests"), ("free", "free"), ("total", "in the pool")):
            g = GaugeMetricFamily(f"enc2dec_kv_blocks_{kind}", f"KV cache blocks {doc}, per pool", labels=["pool"])
            for pool in ("self", "cross"):
                g.add_metric([pool], stats[f"{pool}_{kind}"])
            yield g
        if "steps" in stats:
            yield from _step_metrics(stats["steps"])
        if "replicas" in stats:
            yield from _replica_metrics(stats["replicas"])


# The engine's step counters (EngineCore.StepCounters) under their Prometheus names. Their rates
# say where a serving loss lies: steps per second and rows per step fall when the engine slows,
# and stay when the time goes around it (HTTP, the API processes, the clients).
STEP_METRICS = {
    "num_steps": ("enc2dec_engine_steps_total", "Engine steps that launched work"),
    "num_rows": ("enc2dec_engine_step_rows_total", "Decoder rows launched, summed over steps"),
    "num_encodes": ("enc2dec_engine_encodes_total", "Requests encoded"),
    "step_s": ("enc2dec_engine_step_seconds_total", "Time the step loop spent in steps"),
    "device_wait_s": ("enc2dec_engine_device_wait_seconds_total", "Time the step loop waited for the "
                      "device's results (near the step time: the device bounds the loop; near 0: the host)"),
    "num_finished": ("enc2dec_engine_requests_finished_total", "Requests the engine finished"),
    "first_token_s": ("enc2dec_engine_first_token_seconds_total", "Arrival in the engine to first token, "
                      "summed over finished requests"),
    "finish_s": ("enc2dec_engine_finish_seconds_total", "Arrival in the engine to finish, summed over finished "
                 "requests (a client's latency less this: the time a request spent outside the engine)"),
}


def _step_metrics(steps: dict):
    from prometheus_client.core import CounterMetricFamily

    for key, (name, doc) in STEP_METRICS.items():
        if key in steps:
            # The family's name drops "_total": the exposition adds it back to a counter.
            c = CounterMetricFamily(name.removesuffix("_total"), doc)
            c.add_metric([], steps[key])
            yield c


def _replica_metrics(replicas: list[dict]):
    """A data-parallel engine's replicas, by a ``replica`` label (the unlabelled gauges above are
    the live replicas' sums). A dead replica reports its health and routed count only: its last
    counters describe work that was failed."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    healthy = GaugeMetricFamily("enc2dec_replica_healthy", "1 while the replica's engine process serves, 0 once "
                                "it has died", labels=["replica"])
    routed = CounterMetricFamily("enc2dec_replica_requests_routed", "Engine requests the front sent to the replica",
                                 labels=["replica"])
    waiting = GaugeMetricFamily("enc2dec_replica_num_requests_waiting", "Requests queued in the replica's engine",
                                labels=["replica"])
    running = GaugeMetricFamily("enc2dec_replica_num_requests_running", "Requests decoding in the replica's engine",
                                labels=["replica"])
    kv = {kind: GaugeMetricFamily(f"enc2dec_replica_kv_blocks_{kind}", f"The replica's KV cache blocks ({kind}), "
                                  "per pool", labels=["replica", "pool"]) for kind in ("used", "free", "total")}
    for r in replicas:
        label = str(r["replica"])
        healthy.add_metric([label], 1 if r["healthy"] else 0)
        routed.add_metric([label], r["routed"])
        if not r["healthy"]:
            continue
        waiting.add_metric([label], r["waiting"])
        running.add_metric([label], r["running"])
        for kind, g in kv.items():
            for pool in ("self", "cross"):
                g.add_metric([label, pool], r[f"{pool}_{kind}"])
    yield from (healthy, routed, waiting, running, *kv.values())


def _gauge(cls, name, doc, value):
    g = cls(name, doc)
    g.add_metric([], value)
    return g
