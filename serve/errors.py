"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure a client can see goes through here: bad fields (400), missing or wrong key
(401), unknown model (404), oversize body (413), overload or draining (503 with
Retry-After), engine failures (500). An unexpected exception is a 500 whose body carries
only a request id (the log has it with the traceback): no internals reach the client.
"""
from __future__ import annotations

import json
import logging

logger = logging.getLogger("enc2dec.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


class APIError(Exception):
    """Raised anywhere in a handler; becomes the JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unavailable(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


# Fields whose type is a union: pydantic reports one error per member; say it once, plainly.
_UNION_FIELDS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
}


def _validation_message(err: dict) -> tuple[str, str | None]:
    """One pydantic/FastAPI error as (message, param)."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "value_error":          # our own validators: their message says it all
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        return (msg if not param or msg.startswith(loc[0]) else f"{param}: {msg}"), param
    if not loc and kind == "missing":
        return "the request body is empty: send a JSON object (Content-Type: application/json)", None
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return ("the request body must be a JSON object; send it with Content-Type: application/json "
                "(or multipart/form-data for audio)"), None
    if loc and loc[0] in _UNION_FIELDS and kind != "missing":
        return _UNION_FIELDS[loc[0]], loc[0]
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"'{param}' is a required field", param
    msg = err.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def error_json(status: int, message: str, param: str | None = None, code: str | None = None, **extra) -> bytes:
    """ASCII-escaped, so no text a client sent can make the error itself fail to encode."""
    body = error_body(status, message, param, code)
    body["error"].update(extra)
    return json.dumps(body, ensure_ascii=True).encode()


def install_handlers(app) -> None:
    """Map every exception a request can raise to an OpenAI-style JSON response. Anything
    else is the middleware's: a 500 with a request id (see ``ServeMiddleware``)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    class AsciiJSONResponse(JSONResponse):
        def render(self, content) -> bytes:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()

    def respond(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
        return AsciiJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return respond(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        if param in _UNION_FIELDS:
            errors = [e for e in errors if _validation_message(e)[1] != param] + [errors[0]]
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return respond(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, " \
                      "/v1/audio/transcriptions, /health, /metrics"
        return respond(exc.status_code, message, headers=getattr(exc, "headers", None))
