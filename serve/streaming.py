"""Server-sent events and client disconnects.

A client that goes away must cancel its engine requests, streamed or not, so that their
KV blocks are freed at the next engine step instead of when the request would have
finished. A watcher task waits for the ``http.disconnect`` message and closes the batch;
the stream's own ``finally`` closes it too (whichever comes first; closing is idempotent).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from .errors import APIError, error_body

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(status: int, message: str, code: str | None = None) -> str:
    return sse(error_body(status, message, code=code))


def failed_stream_events(front, out) -> list[str]:
    """The events that end a stream whose request failed: its OpenAI error, then [DONE]."""
    try:
        front.finish(out)
    except APIError as e:
        return [sse_error(e.status, e.message, e.code), SSE_DONE]
    return [SSE_DONE]


async def wait_disconnect(request) -> None:
    """Returns once the client has disconnected (or the response is complete)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def unless_disconnected(request, work: Awaitable):
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` aborts the
    engine requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


def event_stream(request, batch, events: AsyncIterator[str]):
    """A StreamingResponse of ``events`` that aborts ``batch`` when the client leaves."""
    from fastapi.responses import StreamingResponse

    # Started now, not in body(): a client that leaves before the first byte never runs body().
    watcher = asyncio.ensure_future(_close_on_disconnect(request, batch))

    async def body():
        try:
            async for chunk in events:
                yield chunk
        finally:
            watcher.cancel()
            batch.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _close_on_disconnect(request, batch) -> None:
    await wait_disconnect(request)
    # Closing the batch ends the stream normally; the access metrics must still count a 499.
    response = request.scope.get("enc2dec.response")
    if response is not None:
        response["client_gone"] = True
    batch.close()
