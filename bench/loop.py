"""The closed loop: C clients, each sending its next request as soon as its last one is done.

So exactly C requests are in flight until the level's request count (or duration) is
reached; then no new requests start and the ones in flight finish and count. The same
loop drives the in-process engine and an HTTP server; only ``send`` differs.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Sequence

from .metrics import RequestRecord
from .workloads import BenchRequest

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


class Progress:
    """What the loops report to; the CLI passes a Rich progress bar (``report.RichProgress``)."""

    def start(self, label: str, total: int | None) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def stop(self) -> None:
        pass


async def closed_loop(send: Send, requests: Sequence[BenchRequest], concurrency: int,
                      num_requests: int | None, duration_s: float | None,
                      progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Replays ``requests`` (cyclically) with ``concurrency`` clients; returns the records and
    the wall time from the first send to the last completion."""
    if not requests:
        raise ValueError("closed_loop needs at least one request")
    if num_requests is None and duration_s is None:
        raise ValueError("closed_loop needs num_requests or duration_s")
    records: list[RequestRecord] = []
    next_index = 0
    start = time.monotonic()
    deadline = start + duration_s if duration_s is not None else None

    async def client() -> None:
        nonlocal next_index
        while True:
            if num_requests is not None and next_index >= num_requests:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            req = requests[next_index % len(requests)]
            next_index += 1
            records.append(await send(req))
            if progress is not None:
                progress.advance()

    tasks = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:       # one client raised (a bad request): stop the others too
            t.cancel()
    end = max((r.end_s for r in records), default=time.monotonic())
    return records, end - start
