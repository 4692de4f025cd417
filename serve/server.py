"""Run the app on uvicorn, with a SIGTERM drain.

SIGTERM: /health turns 503 (``draining``) and new generation requests get 503 with
Retry-After, while requests in flight run to the end. The whole drain ends within
``drain_timeout_s``: shortly before it, requests still running are cut (a stream gets an
SSE error event, then [DONE]; a plain request a 503), their responses get a moment to
flush, and the server stops; uvicorn's own graceful wait is kept short so it adds nothing
of note. The exit code is then 1 (the drain did not complete), else 0. SIGINT (Ctrl-C) is
uvicorn's usual quick stop. The socket is bound before uvicorn starts so that port 0 works
and the log names the real port.

``--api-processes N``: this process and N-1 spawned ones serve the one port, each with its own
event loop and GIL, all attached to the one engine process this process starts. On Linux each
has a socket of its own on the port (SO_REUSEPORT), so the kernel spreads connections evenly;
elsewhere they share this process's socket. This process turns healthy once the others serve.
SIGTERM is passed on: each drains its own requests, and this one waits for the others before it
stops the engine.
Prometheus counters are kept per process in a shared folder and summed on every scrape
(prometheus-client's multi-process mode).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from .config import ServeConfig

logger = logging.getLogger("enc2dec.serve")


def bind_socket(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """``reuse_port``: other processes may bind the same port (SO_REUSEPORT); the kernel then
    spreads new connections over every listening socket of the group. ``listen=False``: bound
    only (asyncio listens when the server starts), so no connection is queued before then."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)     # connect() queues from now on, while the app starts (no "connection refused")
    sock.set_inheritable(True)
    return sock


def _own_sockets() -> bool:
    """Each API process listens on a socket of its own (SO_REUSEPORT, Linux): the kernel spreads
    connections evenly by their addresses. One shared socket instead lets whichever process is
    idle at the moment accept, and a client's keep-alive connections then stay skewed to it."""
    return hasattr(socket, "SO_REUSEPORT") and sys.platform.startswith("linux")


def make_server(app, config: ServeConfig, workers: list | None = None):
    """``workers``: the other API processes (``multiprocessing`` processes), which a SIGTERM
    reaches through this one and whose exit this one's drain waits for."""
    import uvicorn

    # The caller's list itself: with --api-processes auto the others are added once the engine is up.
    workers = workers if workers is not None else []

    class DrainingServer(uvicorn.Server):
        drain_started: float | None = None
        cut_at: float | None = None
        drain_incomplete = False
        gone: set = set()

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and self.drain_started is None and not self.should_exit:
                self.drain_started = time.monotonic()
                app.state.front.begin_drain()
                logger.info("SIGTERM: draining %d request(s) in flight, taking no new ones",
                            max(0, app.state.http.num_active))
                _signal_all(workers, signal.SIGTERM)
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            front = app.state.front
            if front.state == "failed" and front.llm is None:
                return True                                  # the engine never came up
            for w in workers:
                if w.exitcode is not None and w.pid not in self.gone:
                    self.gone = self.gone | {w.pid}
                    _forget_metrics_of(w.pid)
                    if self.drain_started is None:
                        logger.error("API process %s exited (code %s); the others keep serving", w.name, w.exitcode)
            app.state.metrics.sync_in_flight(front.num_in_flight)
            if self.drain_started is not None:
                elapsed = time.monotonic() - self.drain_started
                if app.state.http.num_active == 0 and all(w.exitcode is not None for w in workers):
                    return True
                timeout = config.drain_timeout_s
                stop_at = timeout - _slice_s(timeout)          # uvicorn's graceful wait comes after
                if self.cut_at is None and elapsed >= stop_at - _slice_s(timeout):
                    self.cut_at, self.drain_incomplete = elapsed, True
                    n = front.cut_all(f"the server shut down before this request finished (--drain-timeout "
                                      f"{timeout:g} s)")
                    logger.warning("drain timeout (%g s): cut %d request(s) still running", timeout, n)
                if elapsed >= stop_at:
                    return True
            return await super().on_tick(counter)

    uv_config = uvicorn.Config(app, log_level=config.log_level, access_log=config.log_level == "debug",
                               timeout_keep_alive=config.keep_alive_s,
                               timeout_graceful_shutdown=_slice_s(config.drain_timeout_s),
                               http=http_protocol(), lifespan="on")
    return DrainingServer(uv_config)


def http_protocol(name: str | None = None) -> type:
    """uvicorn's HTTP/1.1 protocol: httptools (llhttp, the C parser of uvicorn[standard] and vLLM)
    when installed, else h11 (pure Python). With httptools an API process spends 15-19% less CPU per
    request and 1-6% less per streamed token (docs/benchmarks.md, session 22); the per-request
    cost is what a wave of new requests queues behind. Either way a request the parser itself
    refuses (smuggling attempts such as Content-Length beside Transfer-Encoding, malformed heads)
    is answered in the API's JSON error format, as the middleware answers what the parser lets
    through, not with uvicorn's plain-text 400. ``name`` ("httptools" / "h11", or $ENC2DEC_HTTP)
    picks one."""
    name = name or os.environ.get("ENC2DEC_HTTP") or ("httptools" if _has_httptools() else "h11")
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"ENC2DEC_HTTP={name!r}: use httptools or h11")

    class JsonErrorProtocol(base):
        def send_400_response(self, msg: str) -> None:
            import sys

            from .errors import error_json

            # Called from the parser's except clause: its reason (llhttp's or h11's) is the live exception.
            reason = sys.exc_info()[1]
            detail = f": {reason}" if reason is not None and str(reason) else ""
            body = error_json(400, f"the request is not valid HTTP/1.1{detail}"[:400], code="bad_framing")
            head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
            if not self.transport.is_closing():
                self.transport.write(head + body)
                self.transport.close()

    JsonErrorProtocol.__name__ = f"JsonError{base.__name__}"
    return JsonErrorProtocol


def _has_httptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("httptools") is not None


def _slice_s(drain_timeout_s: float) -> float:
    """The drain's last two slices of this length: cut requests flush their last events in the
    first, uvicorn closes connections in the second (its timeout_graceful_shutdown)."""
    return min(1.0, drain_timeout_s / 10)


def run_server(config: ServeConfig, llm_args) -> int:
    """Serve until stopped: 0 after a clean stop, 2 when the engine refused the model or an option
    (its ValueError), 1 when it failed otherwise. Raises ValueError when it cannot listen."""
    from .app import build_app

    fixed = config.api_processes
    auto = fixed is None and llm_args.engine_process and llm_args.data_parallel_size == 1
    multi = auto or (fixed or 1) > 1
    own = multi and _own_sockets()
    try:
        sock = bind_socket(config.host, config.port, reuse_port=own)
    except OSError as e:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    workers, metrics_dir, make_llm = [], None, None
    if multi:
        from enc2dec.engine.engine_process import ProcessLLM, new_attach_address

        # Before prometheus_client is imported anywhere: it picks its multi-process mode then,
        # and the spawned processes inherit the variable.
        metrics_dir = tempfile.mkdtemp(prefix="enc2dec-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        address = new_attach_address()
        ctx = multiprocessing.get_context("spawn")
        listen_on = (config.host, sock.getsockname()[1]) if own else sock     # port 0: the one we got
        started: list = []
        # Opened once every API process is attached: until then each answers 503 "loading",
        # whichever process a connection lands on (shared memory, no lock: one writer, one byte).
        gate = ctx.RawValue("b", 0)

        def spawn(num: int) -> None:
            for i in range(1, num):
                # A pipe, not an Event: no semaphore for the resource tracker to find left over.
                ready, tell = ctx.Pipe(duplex=False)
                w = ctx.Process(target=_api_worker, args=(config, llm_args, address, listen_on, tell, gate),
                                name=f"api-{i}", daemon=True)
                w.start()
                tell.close()
                started.append((w, ready))
                workers.append(w)          # the list make_server holds: it sees them from now on

        if not auto:
            spawn(fixed)

        def make_llm():
            llm = ProcessLLM(llm_args, listen=address)
            if auto and app.state.front.state == "loading":    # sized by the device the engine came up on
                num = auto_api_processes(llm.engine.device)
                logger.info("enc2dec serve: %d API process%s (--api-processes auto)", num, "es" * (num > 1))
                spawn(num)
            _wait_for_workers(started)
            gate.value = 1
            return llm

    app = build_app(config, llm_args=llm_args, make_llm=make_llm)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("enc2dec serve: listening on http://%s:%d (model %s loading%s)", shown, port, config.model,
                f"; {fixed} API processes" if workers else "")
    server = make_server(app, config, workers)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        worker_codes = _stop_workers(workers)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    front = app.state.front
    if front.state == "failed" and front.error:
        logger.error("enc2dec serve: the engine failed: %s", front.error)
        return 2 if front.failed_on_input else 1
    if server.drain_incomplete or 1 in worker_codes:
        logger.error("enc2dec serve: the drain did not complete: requests were cut at --drain-timeout")
        return 1
    return 0


def auto_api_processes(device) -> int:
    """--api-processes auto: a GPU engine streams far more tokens than one Python process can
    format (about 20k/s each), so a quarter of the cores, at most 4; a CPU engine is the
    limit itself, and its cores are better left to it."""
    if getattr(device, "type", str(device)) != "cuda":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))


# Seconds an API process whose first process died gives its open requests before it exits anyway.
PARENT_GONE_GRACE_S = 5.0


def _api_worker(config: ServeConfig, llm_args, address, listen_on, ready, gate) -> None:
    """One more API process: the same app over an attached client of the engine process. It
    takes connections only once attached (its own socket listens from then on), says so
    through ``ready``, and answers as ready only once the first process opens ``gate``, after
    every other one has said so: a process attached early would otherwise report healthy
    while the others still answer 503 "loading"."""
    import threading

    from enc2dec.engine.engine_process import ProcessLLM

    from .app import build_app

    setup_logging(config.log_level, with_pid=True)
    if isinstance(listen_on, tuple):
        sock = bind_socket(*listen_on, reuse_port=True, listen=False)
    else:
        sock = listen_on
    try:
        llm = ProcessLLM.attach(address, llm_args)      # waits until the engine has loaded
    except Exception as e:  # noqa: BLE001 - the first process reports the engine's own failure
        logger.error("API process %d: cannot attach to the engine: %s", os.getpid(), e)
        raise SystemExit(1) from None
    app = build_app(config, llm_args=llm_args, make_llm=lambda: llm)
    app.state.front.gate = lambda: gate.value == 1
    server = make_server(app, config)

    def tell_when_serving():
        while not server.should_exit:
            if server.started and app.state.front.state == "ready":
                ready.send(True)
                ready.close()
                return
            time.sleep(0.02)
    threading.Thread(target=tell_when_serving, daemon=True).start()
    parent = os.getppid()

    def exit_with_the_first_process():
        # A first process killed outright (SIGKILL, the OOM killer) cannot stop this one, which
        # would keep the port and answer 503 forever: a leftover a supervisor cannot see.
        while not server.should_exit:
            if os.getppid() != parent:
                logger.error("API process %d: the first serve process (pid %d) is gone; shutting down",
                             os.getpid(), parent)
                server.should_exit = True
                time.sleep(PARENT_GONE_GRACE_S)
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=exit_with_the_first_process, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    raise SystemExit(1 if server.drain_incomplete else 0)


def _wait_for_workers(started, timeout_s: float = 120.0) -> None:
    """Until every other API process (``started``: (process, its ready pipe) pairs) serves or
    has exited, so that clients which wait for /health never find one still attaching."""
    deadline = time.monotonic() + timeout_s
    for w, ready in started:
        while not ready.poll(0.1):
            if w.exitcode is not None:
                break
            if time.monotonic() > deadline:
                logger.warning("API process %s did not start within %g s; serving without it", w.name, timeout_s)
                break
        ready.close()


def setup_logging(level: str, with_pid: bool = False) -> None:
    """The server's log lines on stderr; ``with_pid`` names the process (the other API processes)."""
    log = logging.getLogger("enc2dec")
    if not log.handlers:
        name = f"%(name)s[{os.getpid()}]" if with_pid else "%(name)s"
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _signal_all(workers, sig) -> None:
    for w in workers:
        if w.exitcode is None:
            try:
                os.kill(w.pid, sig)
            except ProcessLookupError:
                pass


def _stop_workers(workers) -> list[int | None]:
    """After this process stopped serving: the others stop too, then their exit codes. SIGTERM:
    their drain ends at once (the engine has stopped, so their requests have ended); uvicorn
    would re-raise a SIGINT as a KeyboardInterrupt traceback."""
    _signal_all(workers, signal.SIGTERM)
    for w in workers:
        w.join(10)
        if w.exitcode is None:
            w.kill()
            w.join(5)
    return [w.exitcode for w in workers]


def _forget_metrics_of(pid: int) -> None:
    """A finished API process's live gauges leave the sums (its counters stay counted)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
