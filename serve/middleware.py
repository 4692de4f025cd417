"""One ASGI middleware in front of every route: API key, HTTP framing and body limits, body
read timeout, request ids, unexpected errors, request accounting.

Pure ASGI (no Starlette ``BaseHTTPMiddleware``) so streamed responses pass through
untouched and a client disconnect still reaches the route.

Bodies are counted as they arrive, whatever the framing says: a Content-Length header is
only an early refusal, never trusted as the size. A request with both Content-Length and
Transfer-Encoding is refused and its connection closed (RFC 9112 section 6.3: a server
must not reuse a connection whose framing is ambiguous). Every response carries
``x-request-id``; an exception no handler maps is a 500 naming only that id (the log has
the traceback), and the connection stays usable.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from .errors import error_json

logger = logging.getLogger("enc2dec.serve")

OPEN_PATHS = ("/health",)          # reachable without the API key (load balancers, orchestrators)
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models",
                   "/health", "/version", "/metrics")
_CLOSE = [(b"connection", b"close")]


class _TooLarge(Exception):
    pass


async def _send_error(send, status: int, message: str, code: str | None = None, headers=(), **extra) -> None:
    body = error_json(status, message, code=code, **extra)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ServeMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics=None, activity=None,
                 body_timeout_s: float | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics
        self.activity = activity   # .num_active: HTTP requests in progress (a SIGTERM drain waits for zero)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["enc2dec.received"] = time.monotonic()    # a stream's phases start here (ServeMetrics.observe_stream)
        path = scope["path"]
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        state = {"status": None, "complete": False}
        request_id = uuid.uuid4().hex[:16]

        async def send_tracked(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        if self.activity is not None:
            self.activity.num_active += 1
        try:
            if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                await _send_error(send_tracked, 401, "missing or incorrect API key: send the header "
                                  "'Authorization: Bearer <key>'", code="invalid_api_key",
                                  headers=[(b"www-authenticate", b"Bearer")])
                return
            headers = scope.get("headers") or ()
            lengths = [v for k, v in headers if k == b"content-length"]
            chunked = any(k == b"transfer-encoding" for k, _ in headers)
            if lengths and chunked or len(set(lengths)) > 1 or any(not v.strip().isdigit() for v in lengths):
                await _send_error(send_tracked, 400, "ambiguous request framing: send either Content-Length or "
                                  "Transfer-Encoding, once (RFC 9112)", code="bad_framing", headers=_CLOSE)
                return
            if lengths and int(lengths[0]) > self.max_body_bytes:
                await _send_error(send_tracked, 413, self._too_large_message(int(lengths[0])),
                                  code="request_too_large", headers=_CLOSE)
                return
            if scope["method"] in ("POST", "PUT", "PATCH"):
                try:
                    receive = await asyncio.wait_for(self._buffered(receive), self.body_timeout_s)
                except _TooLarge:
                    await _send_error(send_tracked, 413, self._too_large_message(None), code="request_too_large",
                                      headers=_CLOSE)
                    return
                except asyncio.TimeoutError:
                    await _send_error(send_tracked, 408, f"the request body did not arrive within "
                                      f"{self.body_timeout_s:g} s (--request-timeout-s)", code="request_timeout",
                                      headers=_CLOSE)
                    return
            # The routes mark a stream they ended because its client left (streaming.event_stream):
            # such a stream still ends with a closing body message, but it was not delivered.
            scope["enc2dec.response"] = state
            await self.app(scope, receive, send_tracked)
        except Exception:  # noqa: BLE001 - nothing unexpected may reach the client or kill the connection
            logger.exception("request %s: unhandled error on %s %s", request_id, scope["method"], path)
            if state["status"] is None:
                await _send_error(send_tracked, 500, f"internal server error (request id {request_id}; the "
                                  "server log has the details)", code="internal_error", request_id=request_id)
        finally:
            if self.activity is not None:
                self.activity.num_active -= 1
            if self.metrics is not None:
                # 499: the client went away before the response was complete (nginx's convention).
                delivered = state["complete"] and not state.get("client_gone")
                status = state["status"] if delivered or state["status"] is None else 499
                self.metrics.requests.labels(endpoint=endpoint, status=str(status or 499)).inc()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    def _too_large_message(self, num_bytes: int | None) -> str:
        size = f"{num_bytes} bytes" if num_bytes is not None else "more than that"
        return (f"the request body is too large ({size}); this server takes at most {self.max_body_bytes} bytes "
                "(--max-upload-mb)")

    async def _buffered(self, receive):
        """The whole body, counted as it arrives (bounded), then replayed to the route."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise _TooLarge()
            if not message.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages, receive):
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed
