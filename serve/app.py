"""The FastAPI app: routes, error handlers, middleware and the engine's life cycle.

The server listens at once and loads the engine in the background: /health answers 503
(``loading``) until the engine is up, then 200, and 503 again while draining or once the
engine thread has died (``failed``). A data-parallel engine stays 200 while one replica
serves; the body then lists every replica's status (``degraded`` once one has died).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from .config import ServeConfig
from .engine_front import EngineFront
from .errors import install_handlers
from .metrics import ServeMetrics
from .middleware import ServeMiddleware

logger = logging.getLogger("enc2dec.serve")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("enc2dec")
    except PackageNotFoundError:
        return "unknown"


def build_app(config: ServeConfig, make_llm: Callable[[], Any] | None = None, llm_args=None):
    """The ASGI app. ``make_llm`` builds the engine (called once, in a worker thread); by
    default ``LLM.from_args(llm_args)``."""
    from fastapi import FastAPI, Response
    from fastapi.responses import JSONResponse

    from . import audio, completions

    if make_llm is None:
        if llm_args is None:
            raise ValueError("build_app needs make_llm or llm_args")

        def make_llm():
            from enc2dec.engine import LLM

            return LLM.from_args(llm_args)

    front = EngineFront(config, make_llm)
    metrics = ServeMetrics(config.model_name, front.stats, lambda: front.num_in_flight)
    front.metrics = metrics
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loading = asyncio.ensure_future(front.start())
        watch = asyncio.ensure_future(metrics.watch_loop())
        try:
            yield
        finally:
            watch.cancel()
            front.begin_drain()
            await asyncio.shield(loading)       # a load in progress cannot be interrupted
            await front.shutdown()

    app = FastAPI(title="enc2dec", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible server for encoder-decoder models")
    app.state.front, app.state.metrics, app.state.config = front, metrics, config
    app.state.http = SimpleNamespace(num_active=0)
    install_handlers(app)
    app.add_middleware(ServeMiddleware, api_key=config.api_key, max_body_bytes=config.max_upload_bytes,
                       metrics=metrics, activity=app.state.http, body_timeout_s=config.request_timeout_s)
    if config.allowed_origins:       # outermost, so preflights and 401s carry the CORS headers too
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], expose_headers=["x-request-id"])
    completions.register(app, front, config)
    audio.register(app, front, config)

    @app.get("/health")
    async def health():
        # Data parallel: 200 while one replica serves ("degraded" once one has died), and the
        # replicas listed with each one's status.
        replicas = front.replica_health()
        if front.is_ready:
            if replicas is None:
                return {"status": "ok"}
            return {"status": "ok" if all(r["status"] == "ok" for r in replicas) else "degraded",
                    "replicas": replicas}
        status = front.status
        body = {"status": status}
        if front.error:
            body["error"] = front.error
        if replicas is not None:
            body["replicas"] = replicas
        headers = {"Retry-After": str(config.retry_after_s)} if status in ("loading", "draining") else None
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    def model_card(name: str) -> dict:
        info, extra = front.info, {}
        if info is not None:
            extra = {"model_type": info.model_type,
                     "max_model_len": info.max_input_len if not info.is_whisper else info.max_decoder_positions}
        # root names a served name, never the folder the engine loaded (a filesystem path)
        return {"id": name, "object": "model", "created": created, "owned_by": "enc2dec",
                "root": config.model_name, "parent": None, **extra}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in config.served_model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        completions.check_model(config, name or None)
        return model_card(name if name in config.served_model_names else config.model_name)

    @app.get("/metrics")
    async def prometheus():
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return app
