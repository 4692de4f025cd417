"""The engine core in its own process: the ``LLM`` surface, with the step loop in a child.

Why: a server runs its HTTP event loop and the engine's step loop in one interpreter, so the
two share one GIL and the step loop starves under many streams. Here a child process
(``spawn``: CUDA is initialised only there) builds the normal in-process ``LLM`` and only
steps; the parent keeps HTTP, SSE formatting and the public handles.

Wire (``multiprocessing.connection`` pipe, pickle protocol 5), parent -> child:
``("add", id, [(request_id, inputs, params, streaming), ...])``, ``("abort", request_id)``,
``("call", id, fn)``, ``("shutdown",)``. Child -> parent:
``("ready", EngineSnapshot)`` or ``("failed", exception)`` once, then ``("reply", id, ok,
value)`` for the calls that wait, and ``("out", [delta, ...], stats)``, ONE message per engine
step holding every request's new tokens, text and logprobs, as the engine core gives them
(``make_request(deltas=True)``, layout in ``EngineCore._delta``: never the cumulative lists, which
would make a stream of L tokens cost O(L^2) in the core and on the wire), and the scheduler's counters, so
``stats()`` in the parent is a plain read (serve's admission asks for it per request). The
parent rebuilds cumulative ``RequestOutput`` objects from the deltas, so callers see exactly
what the in-process ``LLM`` gives them.

The client holds no global state (one pipe, one reader thread, its own handles), so a
front can hold several of them, one per GPU.

More API processes over one engine (``enc2dec serve --api-processes N``): started with
``listen=True``, the child also accepts clients on a Unix socket (``ProcessLLM.attach``,
authenticated by a random key). Each client is a connection with the same wire; each gets
only its own requests' outputs, and every step's counters. A client that goes away has its
requests aborted; only the first client (the one that spawned the engine) stops it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import gc
import itertools
import multiprocessing
import os
import pickle
import tempfile
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from enc2dec.engine.config import LlmArgs
from enc2dec.engine.lifecycle import ShutdownOnExit
from enc2dec.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

START_TIMEOUT_S = 3600.0      # loading a large checkpoint from a slow disk can take minutes
SHUTDOWN_TIMEOUT_S = 30.0


def _dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


class EngineProcessError(RuntimeError):
    """The engine process died or could not be reached."""


@dataclass
class EngineSnapshot:
    """What the API side reads of the engine, taken once at start-up (picklable): the facts
    ``serve`` and the Whisper code read from ``llm.engine`` in-process, under the same names."""

    hf_config: Any
    processor: SimpleNamespace
    limits: Any
    runner: SimpleNamespace
    is_whisper: bool
    tokenizer: Any
    model_info: dict
    stats: dict
    device: Any = None         # torch.device as the engine process sees it (its GPU 0 is its first visible one)
    dtype: Any = None
    pid: int | None = None     # the engine process


def _snapshot(llm) -> EngineSnapshot:
    core, proc = llm.engine, llm.engine.processor
    processor = SimpleNamespace(**{name: getattr(proc, name, None) for name in (
        "gen", "feature_extractor", "max_input_len", "max_seq_len", "vocab_size", "is_whisper",
        "decoder_start_token_id", "forced_bos_token_id", "eos_token_ids", "max_decoder_positions",
        "max_encoder_positions", "suppress_token_ids", "begin_suppress_token_ids", "whisper_default_prefix")})
    model = getattr(core.runner, "model", None)
    runner = SimpleNamespace(model=SimpleNamespace(
        max_encoder_positions=getattr(model, "max_encoder_positions", None)))
    return EngineSnapshot(core.hf_config, processor, core.limits, runner, core.is_whisper, llm.tokenizer,
                          llm.model_info, _stats(llm), core.device, core.dtype, os.getpid())


def _stats(llm) -> dict:
    """``LLM.stats()`` plus the running decoder sequences (serve's queue bound counts those)."""
    return {**llm.stats(), "running_seqs": llm.engine.scheduler.num_running_seqs}


# ---- child side ---------------------------------------------------------------------------------
class _ChildSender:
    """Writes messages to one client in order.

    A step's output message is pickled and written by a thread of its own (``send_later``):
    the step loop only hands it over, and the pickling and the pipe write run while the
    step loop waits for the GPU (its synchronize releases the GIL). Every other message
    (``send``) is pickled at once, so an unpicklable reply still fails its caller, and is
    written after everything queued before it."""

    def __init__(self, conn):
        self.conn = conn
        self._cv = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._busy = False                         # the writer thread holds a message
        self._writer: threading.Thread | None = None

    def send(self, msg) -> None:
        data = _dumps(msg)
        with self._cv:
            while self._pending or self._busy:
                self._cv.wait()
            self.conn.send_bytes(data)

    def send_later(self, msg) -> None:
        with self._cv:
            self._pending.append(msg)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True, name="enc2dec-engine-send")
                self._writer.start()
            self._cv.notify_all()

    def _write_queued(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                msg = self._pending.popleft()
                self._busy = True
            try:
                self.conn.send_bytes(_dumps(msg))
            except (OSError, ValueError):
                pass                # the client is gone: its command thread sees EOF and forgets it
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


class _Clients:
    """The engine's API clients: each request's outputs go to the connection that added it.
    With one client (the usual case) that is a plain forward."""

    def __init__(self, first: _ChildSender):
        self.senders = [first]
        self.owner: dict[str, _ChildSender] = {}     # request id -> its client, for clients after the first
        self.lock = threading.Lock()

    def add(self, sender: _ChildSender) -> None:
        with self.lock:
            self.senders = [*self.senders, sender]

    def remove(self, sender: _ChildSender) -> list[str]:
        """Forget a client; the ids of its requests still running (to abort)."""
        with self.lock:
            self.senders = [s for s in self.senders if s is not sender]
            mine = [rid for rid, s in self.owner.items() if s is sender]
            for rid in mine:
                del self.owner[rid]
        return mine

    def deliver(self, outputs, stats) -> None:
        senders = self.senders
        if len(senders) == 1:
            senders[0].send_later(("out", outputs, stats))
            return
        first, groups = senders[0], {}
        for delta in outputs:
            rid = delta[0]
            sender = self.owner.get(rid, first)
            if delta[3]:
                self.owner.pop(rid, None)
            groups.setdefault(id(sender), (sender, []))[1].append(delta)
        # Every client gets the step's counters (its admission reads them), with or without outputs.
        for sender in senders:
            group = groups.get(id(sender))
            sender.send_later(("out", group[1] if group else [], stats))

    def broadcast(self, msg) -> None:
        for sender in self.senders:
            try:
                sender.send(msg)
            except OSError:
                pass


def _child_main(args: LlmArgs, conn, env: dict | None = None, num_threads: int | None = None,
                listen: tuple[str, bytes] | None = None) -> None:
    """``listen``: (Unix socket path, key) on which further API clients attach."""
    import signal

    # Placement first, before anything initialises CUDA or sizes a thread pool: a data-parallel
    # replica sees only its own GPUs (CUDA_VISIBLE_DEVICES, which its TP workers inherit) or
    # its share of the cores.
    os.environ.update(env or {})
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)

    from enc2dec.engine.llm import LLM

    # Ctrl-C reaches the whole process group: the parent decides when the engine stops (a
    # server drains first) and ends it through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    sender = _ChildSender(conn)
    clients = _Clients(sender)

    class _ChildLLM(LLM):
        """The in-process LLM whose outputs go to its clients, one message per step."""

        def _loop(self) -> None:
            try:
                super()._loop()
            finally:
                if self._error is not None and not self._stop:    # the step loop died: say so
                    clients.broadcast(("dead", _portable(self._error)))

        def _deliver(self, outputs) -> None:      # deltas (EngineCore._delta): request id [0], finished [3]
            outputs = list(outputs)
            for delta in outputs:
                if delta[3]:
                    self._handles.pop(delta[0], None)
            if outputs:
                clients.deliver(outputs, _stats(self))

    try:
        llm = _ChildLLM.from_args(dataclasses.replace(args, engine_process=False))
        snapshot = _snapshot(llm)
    except BaseException as e:  # noqa: BLE001 - the parent raises it as the in-process LLM would
        try:
            sender.send(("failed", _portable(e)))
        finally:
            conn.close()
        return
    stop_listening = _accept_clients(llm, clients, listen) if listen is not None else None
    sender.send(("ready", snapshot))
    try:
        _serve_commands(llm, conn, sender, clients)
    finally:
        if stop_listening is not None:
            stop_listening()
        llm.shutdown()
        clients.broadcast(("closed",))       # the first client and any attached one
        conn.close()
        # The process ends here: the interpreter's last collection would walk the whole heap
        # (the model's modules, transformers' import graph) for nothing, 1.3 s of a server's
        # SIGTERM drain on a 2-core AMD EPYC. Frozen objects are outside every generation.
        gc.freeze()


def _accept_clients(llm, clients: _Clients, listen: tuple[str, bytes]):
    """A thread accepting API clients on ``listen`` (path, key); each gets the start-up
    snapshot, then its own command thread. Returns the function that stops it."""
    from multiprocessing.connection import Listener

    address, key = listen
    listener = Listener(address, family="AF_UNIX", authkey=key)
    closed = threading.Event()

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a wrong key or a client gone mid-handshake: refuse it
                if closed.is_set():                  # the engine is stopping
                    return
                continue
            sender = _ChildSender(conn)
            try:
                sender.send(("ready", _snapshot(llm)))
            except OSError:
                conn.close()
                continue
            clients.add(sender)
            threading.Thread(target=_serve_client, args=(llm, conn, sender, clients), daemon=True,
                             name="enc2dec-engine-client").start()

    threading.Thread(target=accept, daemon=True, name="enc2dec-engine-listener").start()

    def stop() -> None:
        closed.set()
        listener.close()
    return stop


def _serve_client(llm, conn, sender: _ChildSender, clients: _Clients) -> None:
    """An attached client's commands until it detaches or goes away; then its requests end."""
    try:
        _serve_commands(llm, conn, sender, clients, first=False)
    finally:
        for rid in clients.remove(sender):
            llm._abort(rid)
        try:
            sender.send(("closed",))
        except OSError:
            pass
        conn.close()


def _serve_commands(llm, conn, sender: _ChildSender, clients: _Clients, first: bool = True) -> None:
    core = llm.engine
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return                                    # the client is gone
        kind = msg[0]
        if kind == "add":
            _, call_id, payload = msg
            # make_request validates and touches no engine state: it runs here, beside the
            # step loop, so a request is answered without waiting for a step boundary.
            tracked, errors = [], []
            try:
                batch = pickle.loads(payload)
            except Exception as e:  # noqa: BLE001 - e.g. a class only the parent's __main__ defines
                sender.send(("reply", call_id, False, RuntimeError(f"the request cannot be read in the "
                                                                   f"engine process: {e!r}")))
                continue
            for i, (rid, inputs, text, params, streaming) in enumerate(batch):
                try:
                    t = core.make_request(inputs, params, streaming, request_id=rid, deltas=True)
                    if text is not None:          # tokenised by the parent: the output names the text
                        t.prompt = text
                    tracked.append(t)
                except Exception as e:  # noqa: BLE001 - the caller gets it, as in-process
                    errors.append((i, _portable(e)))
            # Replies to adds are queued behind the step outputs (send_later), not written here
            # once the writer has drained (send): that wait costs this thread GIL hand-offs with
            # the writer and a busy step loop for every add, and the client's next adds queue
            # behind it. The parent registers the handles before it sends, so an output may
            # come before its reply.
            if errors:
                sender.send_later(("reply", call_id, False, errors))
                continue
            if not first:
                for t in tracked:
                    clients.owner[t.request.request_id] = sender
            try:
                llm._submit_all(tracked)     # one engine command: admitted between the same two steps
            except RuntimeError as e:
                sender.send_later(("reply", call_id, False, _portable(e)))
                continue
            sender.send_later(("reply", call_id, True, None))
        elif kind == "abort":
            llm._abort(msg[1])
        elif kind == "call":
            _, call_id, payload = msg
            try:
                future = llm.call_on_engine(pickle.loads(payload))
            except Exception as e:  # noqa: BLE001 - shut down, or a callable that does not unpickle here
                sender.send(("reply", call_id, False, _portable(e)))
                continue
            future.add_done_callback(_reply_when_done(sender, call_id))
        elif kind in ("shutdown", "detach"):        # an attached client's shutdown only detaches it
            return


def _reply_when_done(sender: _ChildSender, call_id: int):
    def reply(future: concurrent.futures.Future) -> None:
        e = future.exception()
        try:
            sender.send(("reply", call_id, e is None, future.result() if e is None else _portable(e)))
        except Exception as send_error:  # noqa: BLE001 - e.g. a result that does not pickle
            sender.send(("reply", call_id, False, RuntimeError(f"the call's result cannot be sent: {send_error}")))
    return reply


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (same type and message in the parent), else a RuntimeError
    that names it."""
    try:
        pickle.loads(_dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


# ---- parent side --------------------------------------------------------------------------------
def new_attach_address() -> tuple[str, bytes]:
    """A fresh (Unix socket path, key) for ``ProcessLLM(listen=...)``: a private folder of its
    own, and 32 random bytes that a client must prove it knows."""
    folder = tempfile.mkdtemp(prefix="enc2dec-engine-")
    return os.path.join(folder, "engine.sock"), os.urandom(32)


def _remove_socket(path: str) -> None:
    for remove in (os.remove, os.rmdir):
        try:
            remove(path)
        except OSError:
            pass
        path = os.path.dirname(path)


def _connect(path: str, key: bytes):
    """A connection to the engine listening on ``path``, once it is there (it listens only once
    its model has loaded)."""
    from multiprocessing.connection import Client

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return Client(path, family="AF_UNIX", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise EngineProcessError(f"no engine process listens on {path}") from None
            time.sleep(0.2)
        except multiprocessing.AuthenticationError:
            raise EngineProcessError(f"the engine process on {path} refused the key") from None


class _Stream:
    """The parent's cumulative view of one request, rebuilt from the child's deltas."""

    __slots__ = ("prompt", "prompt_token_ids", "comps", "metrics")

    def __init__(self):
        self.prompt, self.prompt_token_ids = None, []
        self.comps: dict[int, list] = {}     # index -> [token_ids, text, logprobs]
        self.metrics = RequestMetrics()

    def apply(self, rid, head, comps, finished, error, metrics) -> RequestOutput:
        """One delta (``EngineCore._delta``'s layout) onto the request's cumulative output."""
        if head is not None:
            self.prompt, self.prompt_token_ids = head
        m = self.metrics
        (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
         m.num_preemptions, new_times) = metrics
        m.token_times.extend(new_times)
        outs = []
        for index, new_ids, text, text_replaces, finish, stop, cum_lp, new_lps, prefix_lps in comps:
            state = self.comps.get(index)
            if state is None:
                state = self.comps[index] = [[], "", None]
            state[0].extend(new_ids)
            state[1] = text if text_replaces else state[1] + text
            if new_lps is not None:
                if state[2] is None:
                    state[2] = []
                state[2].extend(new_lps)
            # New lists per output, as in-process: a caller may keep an earlier one.
            outs.append(CompletionOutput(index, state[1], list(state[0]), finish, stop, cum_lp,
                                         None if state[2] is None else list(state[2]), prefix_lps))
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, outs, finished, m, error)


class ProcessLLM(ShutdownOnExit):
    """``LLM`` with its engine in a child process (``LlmArgs.engine_process=True``)."""

    # What the child runs: ``(args, conn, env, num_threads)``. A lab script measuring the API side
    # alone swaps in a child that speaks the same wire without a model (bench/scripts/serve_overhead.py).
    child_main = staticmethod(_child_main)

    def __init__(self, args: LlmArgs, *, env: dict | None = None, num_threads: int | None = None,
                 name: str = "engine process", listen: bool | tuple[str, bytes] = False,
                 _attach: tuple[str, bytes] | None = None):
        """``env`` (environment variables) and ``num_threads`` (torch threads) apply in the child
        before the engine is built; ``name`` is how errors call this process (a replica's).
        ``listen``: other processes may attach to this engine (``attach``) at ``attach_address``;
        True picks one, or pass ``new_attach_address()`` made beforehand."""
        from enc2dec.engine.llm import RequestHandle

        self._handle_cls = RequestHandle
        self.args = args
        self._handles: dict[str, Any] = {}
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()            # handles, streams, replies; and the pipe's send side
        self._ids = itertools.count()
        self._rid_prefix = f"req-{os.getpid()}-{id(self):x}-"
        self._stop = False
        self._error: BaseException | None = None
        self.name = name
        self.attach_address: tuple[str, bytes] | None = None
        if _attach is not None:
            self._proc = None
            self._conn = _connect(*_attach)
        else:
            if listen is True:
                listen = new_attach_address()
            if listen:
                self.attach_address = listen
            ctx = multiprocessing.get_context("spawn")
            self._conn, child_conn = ctx.Pipe(duplex=True)
            extra = (self.attach_address,) if listen else ()
            self._proc = ctx.Process(target=self.child_main, args=(args, child_conn, env, num_threads, *extra),
                                     name="enc2dec-engine-core", daemon=True)
            self._proc.start()
            child_conn.close()                       # the child's death must end our reads with EOF
        self._snapshot = self._wait_ready()
        self._stats = self._snapshot.stats
        self._reader = threading.Thread(target=self._read_loop, name="enc2dec-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def attach(cls, address: tuple[str, bytes], args: LlmArgs | None = None, *,
               name: str = "engine process") -> "ProcessLLM":
        """A client of an engine another process started with ``listen=True`` (its
        ``attach_address``): the same surface, its own requests. Waits until that engine is up
        (its socket appears once the model has loaded). ``shutdown()`` detaches; the engine
        stops with the process that started it."""
        return cls(args, name=name, _attach=address)

    @classmethod
    def from_args(cls, args: LlmArgs) -> "ProcessLLM":
        return cls(args)

    def _wait_ready(self) -> EngineSnapshot:
        deadline = time.monotonic() + START_TIMEOUT_S
        if self._proc is None:                   # attached: the engine answers at once
            try:
                msg = pickle.loads(self._conn.recv_bytes()) if self._conn.poll(SHUTDOWN_TIMEOUT_S) else None
            except (EOFError, OSError):
                msg = None
            if msg is None or msg[0] != "ready":
                self._conn.close()
                raise EngineProcessError(f"the {self.name} did not answer on its socket")
            return msg[1]
        while True:
            if self._conn.poll(0.1):
                try:
                    msg = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "ready":
                    return msg[1]
                self._proc.join(5)
                self._conn.close()
                if msg is not None and msg[0] == "failed":
                    raise msg[1]
                raise EngineProcessError(f"the engine process exited during start-up "
                                         f"(exit code {self._proc.exitcode})")
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.kill()
                self._proc.join(5)
                self._conn.close()
                raise EngineProcessError(f"the engine process did not start (exit code {self._proc.exitcode})")

    # ---- what the in-process LLM exposes ----------------------------------------------------------
    @property
    def tokenizer(self):
        return self._snapshot.tokenizer

    @property
    def engine(self) -> EngineSnapshot:
        """A start-up snapshot of the engine's facts (config, processor, limits), not the core."""
        return self._snapshot

    @property
    def model_info(self) -> dict:
        return dict(self._snapshot.model_info)

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid if self._proc is not None else self._snapshot.pid

    @property
    def is_healthy(self) -> bool:
        # The reader ends (and sets the error) when the engine's end of the pipe closes, which its
        # death does: no waitpid per request.
        return not self._stop and self._error is None and self._reader.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stats(self) -> dict:
        """Queue depth, running sequences and KV blocks per pool, as of the engine's last step
        (or abort): the counters ride on every output message, so this never waits."""
        return self._stats

    def kv_cache_usage(self) -> dict[str, dict[str, int]]:
        return self.stats()["kv"]

    def reset_kv_peaks(self) -> None:
        from enc2dec.engine.llm import reset_kv_peaks

        # The stats otherwise ride on step outputs: until the next step they would show the old peak.
        self._stats = {**self._stats, "kv": self.call_on_engine(reset_kv_peaks).result()}

    def queue_stats(self) -> dict[str, int]:
        s = self.stats()
        return {"waiting": s["waiting"], "running": s["running"]}

    def generate(self, inputs, sampling_params=None, use_tqdm: bool = True):
        from enc2dec.engine.llm import batch_of, wait_all

        single, prompts, params = batch_of(inputs, sampling_params)
        handles = self._add([(p, sp, False) for p, sp in zip(prompts, params)], single)
        results = wait_all(handles, use_tqdm and len(handles) > 1)
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        return results[0] if single else results

    def generate_async(self, inputs, sampling_params=None, streaming: bool = False):
        return self._add([(inputs, sampling_params, streaming)], True)[0]

    def call_on_engine(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine_core)`` in the engine process between two steps. ``fn`` and its result
        cross the process boundary, so ``fn`` must pickle: a module-level function, or a
        ``functools.partial`` of one."""
        return self._request("call", fn)

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            self._send(("shutdown" if self._proc is not None else "detach",))
        except (OSError, ValueError):
            pass
        if self._proc is not None:
            self._proc.join(SHUTDOWN_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            if self.attach_address is not None:
                _remove_socket(self.attach_address[0])
        self._reader.join(SHUTDOWN_TIMEOUT_S)
        self._fail_all("engine shut down")
        self._conn.close()

    # ---- the wire -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._stop:
            raise RuntimeError("the LLM has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the {self.name} died: {self._error!r}")

    def _send(self, msg) -> None:
        data = _dumps(msg)
        with self._lock:
            self._conn.send_bytes(data)

    def _request(self, kind: str, *payload) -> concurrent.futures.Future:
        self._check_open()
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        try:
            data = _dumps((kind, call_id, *(_dumps(p) for p in payload)))
        except Exception as e:  # noqa: BLE001 - a closure or lambda
            raise TypeError(f"call_on_engine needs a picklable callable with an engine process "
                            f"(a module-level function or a functools.partial of one): {e}") from None
        with self._lock:
            self._replies[call_id] = future
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as e:
                self._replies.pop(call_id, None)
                raise EngineProcessError(f"the engine process cannot be reached: {e}") from None
        if self._error is not None or not self._reader.is_alive():   # it failed the replies before ours
            self._fail_replies()
        return future

    def _add(self, batch, single: bool, indices: list[int] | None = None) -> list:
        """Handles for ``batch``, all admitted or none. A bad prompt's ValueError names its place
        in the caller's list: ``indices[i]`` when given (a front that split its list), else ``i``."""
        self._check_open()
        handles, wire = [], []
        for inputs, params, streaming in batch:
            rid = f"{self._rid_prefix}{next(self._ids)}"
            handles.append(self._handle_cls(self, rid, streaming))
            wire.append((rid, *self._pretokenize(inputs), params, streaming))
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        try:
            data = _dumps(("add", call_id, _dumps(wire)))
        except Exception as e:  # noqa: BLE001 - e.g. a logits processor that is a closure
            raise ValueError(f"the request cannot be sent to the engine process (it must pickle): {e}") from None
        with self._lock:
            self._replies[call_id] = future
            for h in handles:
                self._handles[h.request_id] = h
                self._streams[h.request_id] = _Stream()
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                pass                      # the reader sees the pipe close and fails the future
        if self._error is not None or not self._reader.is_alive():   # it failed the replies before ours
            self._fail_replies()
        try:
            ok = future.result()
        except BaseException:
            self._forget(handles)
            raise
        if ok is not True:
            self._forget(handles)
            i, error = ok[0]
            if isinstance(error, ValueError) and not single:
                raise ValueError(f"prompt {i if indices is None else indices[i]}: {error}") from None
            raise error
        return handles

    def _pretokenize(self, inputs) -> tuple[Any, str | None]:
        """(what the engine process gets, the prompt text if tokenised here). Text prompts are
        tokenised in the caller's thread (serve's input pool), as ``EngineCore.make_request``
        would, so the engine process only validates ids; audio goes raw (its log-mel is batched
        on the GPU in the engine), and anything unusual is left to the engine's own checks."""
        snap = self._snapshot
        text = inputs if isinstance(inputs, str) else None
        if isinstance(inputs, dict) and set(inputs) == {"prompt"} and isinstance(inputs["prompt"], str):
            text = inputs["prompt"]
        if text is None or snap.is_whisper or snap.tokenizer is None:
            return inputs, None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return inputs, None               # the engine names the bad character
        return list(snap.tokenizer.encode(text, add_special_tokens=True)), text

    def _forget(self, handles) -> None:
        with self._lock:
            for h in handles:
                self._handles.pop(h.request_id, None)
                self._streams.pop(h.request_id, None)

    def _release_caller_pool(self) -> None:
        """Nothing to free: OpenMP throttles the pools of one process, and the engine's is in another."""

    def _abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, ValueError):
            pass                           # the engine is gone: its requests have failed already

    def _read_loop(self) -> None:
        conn = self._conn
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                kind = msg[0]
                if kind == "out":
                    self._stats = msg[2]
                    self._deliver(msg[1])
                elif kind == "reply":
                    _, call_id, ok, value = msg
                    with self._lock:
                        future = self._replies.pop(call_id, None)
                    if future is None or not future.set_running_or_notify_cancel():
                        continue
                    if ok:
                        future.set_result(True if value is None else value)
                    elif isinstance(value, list):          # the add's validation errors
                        future.set_result(value)
                    else:
                        future.set_exception(value)
                elif kind == "dead":            # the step loop died; its requests were failed
                    self._error = msg[1]
                    self._fail_replies()
                elif kind == "closed":
                    break
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a message we cannot read: the link is unusable
            self._error = EngineProcessError(f"bad message from the engine process: {e!r}")
        if not self._stop and self._error is None:
            if self._proc is None:
                self._error = EngineProcessError(f"the {self.name} closed the connection (stopped or died)")
            else:
                self._proc.join(5)
                self._error = EngineProcessError(f"the {self.name} died (exit code {self._proc.exitcode})")
        self._fail_all("engine shut down" if self._error is None else f"engine process died: {self._error}")

    def _deliver(self, deltas) -> None:
        from enc2dec.engine.llm import _set_all

        wake: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for delta in deltas:
            rid, finished = delta[0], delta[3]
            with self._lock:
                handle, stream = self._handles.get(rid), self._streams.get(rid)
                if finished:
                    self._handles.pop(rid, None)
                    self._streams.pop(rid, None)
            if handle is None or stream is None:
                continue
            for loop, event in handle._push(stream.apply(*delta)):
                wake.setdefault(loop, []).append(event)
        # One thread-safe call per event loop per message, as the in-process LLM does per step.
        for loop, events in wake.items():
            loop.call_soon_threadsafe(_set_all, events)

    def _fail_replies(self) -> None:
        with self._lock:
            replies, self._replies = self._replies, {}
        error = self._error or RuntimeError("the LLM was shut down before the call ran")
        for future in replies.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(str(error)))

    def _fail_all(self, message: str) -> None:
        """Every request still pending ends now, as an aborted output carrying ``message``."""
        self._fail_replies()
        with self._lock:
            pending = [(rid, h, self._streams.get(rid)) for rid, h in self._handles.items()]
            self._handles.clear()
            self._streams.clear()
        deltas = []
        for rid, handle, stream in pending:
            stream = stream or _Stream()
            comps = [(i, [], "", False, "abort", None, None, None, None) for i in (stream.comps or [0])]
            m = stream.metrics
            metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, time.monotonic(),
                       m.num_preemptions, [])
            with self._lock:
                self._handles[rid], self._streams[rid] = handle, stream
            deltas.append((rid, None, comps, True, message, metrics))
        if deltas:
            self._deliver(deltas)
