"""One ASGI middleware in front of every route: API key, body size, request accounting.

Pure ASGI (no Starlette ``BaseHTTPMiddleware``) so streamed responses pass through
untouched and a client disconnect still reaches the route.
"""
from __future__ import annotations

import hmac
import json

from .errors import error_body

OPEN_PATHS = ("/health",)          # reachable without the API key (load balancers, orchestrators)
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models",
                   "/health", "/version", "/metrics")


class _TooLarge(Exception):
    pass


async def _send_error(send, status: int, message: str, code: str | None = None, headers=()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ServeMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics=None, activity=None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.activity = activity   # .num_active: HTTP requests in progress (a SIGTERM drain waits for zero)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        state = {"status": None, "complete": False}

        async def send_tracked(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
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
            headers = dict(scope.get("headers") or ())
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await _send_error(send_tracked, 413, self._too_large_message(int(length)), code="request_too_large")
                return
            if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
                try:
                    receive = await self._buffered(receive)
                except _TooLarge:
                    await _send_error(send_tracked, 413, self._too_large_message(None), code="request_too_large")
                    return
            await self.app(scope, receive, send_tracked)
        except Exception:
            if state["status"] is None:          # the error handler answers 500 outside this middleware
                state["status"], state["complete"] = 500, True
            raise
        finally:
            if self.activity is not None:
                self.activity.num_active -= 1
            if self.metrics is not None:
                # 499: the client went away before the response was complete (nginx's convention).
                status = state["status"] if state["complete"] or state["status"] is None else 499
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
        """A chunked body with no Content-Length: read it whole (bounded), then replay it."""
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
