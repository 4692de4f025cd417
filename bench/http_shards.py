"""``bench --url`` from several client processes: one Python process reading SSE streams costs
about 40-60 us of CPU per streamed token (httpx, JSON), so past roughly 20k tokens/s the client,
not the server, would set the figure. K processes each run the closed loop with their share of
the level's concurrency and requests; their records are merged into one level.

The processes start once per run (spawned, so nothing of the parent's event loop is copied) and
keep their connections between levels. Each shard starts at one agreed instant, and
``time.monotonic`` is the same system-wide clock in every process on Linux and macOS, so the
merged level's wall time is simply the first send to the last completion over all records.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import math
import multiprocessing
import os
import time

from .loop import closed_loop
from .metrics import RequestRecord
from .workloads import BenchRequest

# auto: one client process per 8 streams in flight. At 16 a process streaming flan-t5-large at
# C=64 on an H100 ran at 67% CPU with its loop 3.3 ms late at p99, and the level read 4% below
# the same server read by 8 processes (38% CPU each): a client past about half a core distorts
# what it measures (docs/benchmarks.md, session 24).
TOKENS_PER_PROCESS_CONCURRENCY = 8


def auto_client_processes(concurrency: int) -> int:
    """One process per 8 streams in flight, at most half the cores (the server and its engine
    usually share the host), at least one."""
    cores = os.cpu_count() or 1
    return max(1, min(cores // 2, math.ceil(concurrency / TOKENS_PER_PROCESS_CONCURRENCY)))


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal shares, largest first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# This client process's event loop and HttpTarget, kept between levels: the target's connection
# pool belongs to the loop it was made in.
_loop: asyncio.AbstractEventLoop | None = None
_target = None


def _shard(target_args: tuple, reqs: list[BenchRequest], concurrency: int, num_requests: int | None,
           duration_s: float | None, start_at: float) -> list[RequestRecord]:
    from .http_client import HttpTarget

    global _loop, _target
    if _loop is None:
        _loop, _target = asyncio.new_event_loop(), HttpTarget(*target_args)
        # What this process holds from now on (httpx, the workload) lives to its end: frozen, the
        # collector's full passes skip it instead of stalling every stream of the shard mid-level.
        gc.collect()
        gc.freeze()

    async def run():
        delay = start_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lags: list[float] = []
        watch = asyncio.ensure_future(_watch_loop(lags))
        cpu0, wall0 = time.process_time(), time.monotonic()
        try:
            records, _ = await closed_loop(_target.send, reqs, concurrency, num_requests, duration_s)
        finally:
            watch.cancel()
        wall = time.monotonic() - wall0
        return records, ClientLoad((time.process_time() - cpu0) / wall if wall > 0 else 0.0, lags)

    return _loop.run_until_complete(run())


LAG_TICK_S = 0.001


class ClientLoad:
    """How busy one client process was over a level: its CPU time over wall time, and how late
    its event loop ran a 1 ms timer (``lags``, seconds). A loop that runs its timers late also
    reads its streams late: that delay is in the level's TTFT and ITL, and is the client's, not
    the server's."""

    def __init__(self, cpu_frac: float, lags: list[float]):
        self.cpu_frac, self.lags = cpu_frac, lags


async def _watch_loop(lags: list[float]) -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, time.monotonic() - t - LAG_TICK_S))


def client_load_extras(loads: list[ClientLoad]) -> dict:
    """The level's client figures: the busiest process's CPU share, the mean and p99 timer lag
    over all processes (ms)."""
    lags = sorted(x for load in loads for x in load.lags)
    if not loads or not lags:
        return {}
    return {"client_cpu_frac": max(load.cpu_frac for load in loads),
            "client_lag_ms": 1000.0 * sum(lags) / len(lags),
            "client_lag_p99_ms": 1000.0 * lags[min(len(lags) - 1, int(0.99 * len(lags)))]}


class ShardedClients:
    """K client processes running one closed loop between them."""

    def __init__(self, num: int, target_args: tuple):
        self.num = num
        self.target_args = target_args
        self.pool = concurrent.futures.ProcessPoolExecutor(num, mp_context=multiprocessing.get_context("spawn"))
        self.last_load: dict = {}        # the last level's client_load_extras

    def run(self, reqs: list[BenchRequest], concurrency: int, num_requests: int | None,
            duration_s: float | None, progress=None) -> tuple[list[RequestRecord], float]:
        shares = [c for c in split(concurrency, self.num) if c > 0]
        counts = ([max(1, round(num_requests * c / concurrency)) for c in shares] if num_requests is not None
                  else [None] * len(shares))
        if num_requests is not None:                 # rounding: the shares add up to the level's count
            counts[0] += num_requests - sum(counts)
        # Far enough ahead that every process (the first run imports httpx) is waiting when it comes.
        start_at = time.monotonic() + 0.5
        futures = [self.pool.submit(_shard, self.target_args, reqs[i::len(shares)] or reqs, c, n, duration_s,
                                    start_at) for i, (c, n) in enumerate(zip(shares, counts))]
        records: list[RequestRecord] = []
        loads: list[ClientLoad] = []
        for f in concurrent.futures.as_completed(futures):
            part, load = f.result()
            records.extend(part)
            loads.append(load)
            if progress is not None:
                progress.advance(len(part))
        self.last_load = client_load_extras(loads)
        start = min((r.start_s for r in records), default=start_at)
        end = max((r.end_s for r in records), default=start)
        return records, end - start

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class ShardedHttpTarget:
    """An HTTP target whose closed loop runs in ``k`` client processes (``ShardedClients``)."""

    name = "http"

    def __init__(self, target, k: int):
        self._target = target
        self.model = target.model
        self._clients = ShardedClients(k, (target.url, target.model, target.concurrency, target.streaming,
                                           target.timeout_s, target.beam_width))

    async def begin_level(self) -> None:
        await self._target.begin_level()

    async def end_level(self) -> dict:
        return {**await self._target.end_level(), **self._clients.last_load}

    async def closed_loop(self, reqs, concurrency, num_requests, duration_s, progress=None):
        return await asyncio.to_thread(self._clients.run, list(reqs), concurrency, num_requests, duration_s,
                                       progress)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._clients.close)
        await self._target.aclose()
