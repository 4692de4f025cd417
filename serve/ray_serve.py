"""The server as a Ray Serve deployment: one replica = one engine (the same FastAPI app).

    from enc2dec.serve.ray_serve import build_application
    app = build_application(ServeConfig(model="openai/whisper-base"), build_llm_args("openai/whisper-base"),
                            autoscaling_config={"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32})
    ray.serve.run(app, route_prefix="/")      # or: enc2dec serve MODEL --ray-address auto

Ray's proxy routes every request to a replica and scales the replica count; each replica runs
``build_app`` (the same routes, errors, metrics and middleware as ``enc2dec serve``) with its own
engine on ``tensor_parallel_size`` GPUs (none on a CPU engine). A replica counts as started only
once its engine has loaded (a load error fails the deployment with the engine's message), and
Ray's health check follows our /health: a replica whose engine died is replaced. Stopping a
replica drains it (no new requests, in-flight ones finish within ``drain_timeout_s``).
Ray's HTTP proxy, not uvicorn, listens: ``ServeConfig.host``/``port`` go to ``serve.start``.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from .config import ServeConfig

DEPLOYMENT_NAME = "enc2dec"


def _gated_app(config: ServeConfig, llm_args):
    """``build_app`` whose ASGI start-up waits for the engine, so Ray routes nothing to a replica
    that would answer 503 ``loading``."""
    from .app import build_app

    app = build_app(config, llm_args=llm_args)
    front, inner = app.state.front, app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a):
            while front.state == "loading":
                await asyncio.sleep(0.05)
            if front.state == "failed":
                raise RuntimeError(f"the engine failed to start: {front.error}")
            yield

    app.router.lifespan_context = lifespan
    return app


class _Replica:
    """The deployment's class (wrapped by ``serve.ingress`` in ``build_application``)."""

    def __init__(self, config: ServeConfig, llm_args):
        self._enc2dec_app = _gated_app(config, llm_args)

    def __serve_build_asgi_app__(self):
        return self._enc2dec_app

    def check_health(self):
        front = self._enc2dec_app.state.front
        if front.state == "failed" or (front.state == "ready" and not front.is_ready):
            raise RuntimeError(f"the engine is not healthy: {front.error or front.state}")


def build_application(config: ServeConfig, llm_args, *, num_replicas: int | None = None,
                      autoscaling_config: dict | None = None, num_gpus: float | None = None,
                      num_cpus: float = 1, max_ongoing_requests: int | None = None):
    """A bound Ray Serve application (``serve.run`` it). ``autoscaling_config`` is Ray's own
    (``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...); without it
    ``num_replicas`` (default 1) replicas run. ``max_ongoing_requests`` defaults to the server's
    ``max_queue``: the engine queues and batches what Ray lets through."""
    from ray import serve

    from enc2dec.engine.ray_cluster import gpus_per_engine

    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    options = dict(
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_gpus": gpus_per_engine(llm_args) if num_gpus is None else num_gpus,
                           "num_cpus": num_cpus},
        max_ongoing_requests=max_ongoing_requests or config.max_queue,
        graceful_shutdown_timeout_s=config.drain_timeout_s,
        health_check_period_s=10,
    )
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    deployment = serve.deployment(**options)(serve.ingress()(_Replica))
    return deployment.bind(config, llm_args)


def run(config: ServeConfig, llm_args, address: str, **deployment_options) -> int:
    """``enc2dec serve --ray-address``: deploy on the cluster and block until interrupted."""
    import time

    from enc2dec.engine.ray_cluster import connect
    from ray import serve

    connect(address)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_application(config, llm_args, **deployment_options), name=DEPLOYMENT_NAME, route_prefix="/")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
