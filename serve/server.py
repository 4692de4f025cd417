"""Run the app on uvicorn, with a SIGTERM drain.

SIGTERM: /health turns 503 (``draining``) and new generation requests get 503 with
Retry-After, while requests in flight run to the end; once none is left (or after
``drain_timeout_s``) the server stops and the engine shuts down. SIGINT (Ctrl-C) is
uvicorn's usual quick stop. The socket is bound before uvicorn starts so that port 0 works
and the log names the real port.
"""
from __future__ import annotations

import logging
import signal
import socket
import time

from .config import ServeConfig

logger = logging.getLogger("enc2dec.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)         # connect() queues from now on, while the app starts (no "connection refused")
    sock.set_inheritable(True)
    return sock


def make_server(app, config: ServeConfig):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_started: float | None = None

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and self.drain_started is None and not self.should_exit:
                self.drain_started = time.monotonic()
                app.state.front.begin_drain()
                logger.info("SIGTERM: draining %d request(s) in flight, taking no new ones",
                            max(0, app.state.http.num_active))
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            front = app.state.front
            if front.state == "failed" and front.llm is None:
                return True                                  # the engine never came up
            if self.drain_started is not None:
                idle = app.state.http.num_active == 0
                if idle or time.monotonic() - self.drain_started > config.drain_timeout_s:
                    if not idle:
                        logger.warning("drain timeout (%.0f s): stopping with requests in flight",
                                       config.drain_timeout_s)
                    return True
            return await super().on_tick(counter)

    uv_config = uvicorn.Config(app, log_level=config.log_level, access_log=config.log_level == "debug",
                               timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)), lifespan="on")
    return DrainingServer(uv_config)


def run_server(config: ServeConfig, llm_args) -> int:
    """Serve until stopped: 0 after a clean stop, 2 when the engine refused the model or an option
    (its ValueError), 1 when it failed otherwise. Raises ValueError when it cannot listen."""
    from .app import build_app

    try:
        sock = bind_socket(config.host, config.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    app = build_app(config, llm_args=llm_args)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("enc2dec serve: listening on http://%s:%d (model %s loading)", shown, port, config.model)
    server = make_server(app, config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    front = app.state.front
    if front.state == "failed" and front.error:
        logger.error("enc2dec serve: the engine failed: %s", front.error)
        return 2 if front.failed_on_input else 1
    return 0
