"""Tensor-parallel worker processes as seen from the driver: start, watch, stop.

Each worker is a fresh interpreter (``sys.executable -m enc2dec.engine.parallel.worker``, the
spawn model: nothing is inherited but the environment and ``sys.path``), talking to the
driver over one socket pair (pickled tuples, see ``tp_worker.py``). A watcher thread
notices a worker's exit and aborts the group, so a collective stuck on a dead peer
(NCCL) fails instead of hanging.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from enc2dec.engine.parallel.distributed import TensorParallelGroup, WorkerDiedError

STOP_TIMEOUT_S = 10.0
DEATH_GRACE_S = 5.0                       # a failed collective waits this long for the culprit's exit code


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its runner; sent once, pickled."""

    args: Any                  # LlmArgs, tokenizer dropped
    hf_config: Any
    model_path: str | None
    device: torch.device       # the driver's; the worker picks its own rank's device from it
    dtype: torch.dtype
    attn_backend: str
    max_input_len: int
    feature_extractor: Any
    store_port: int
    timeout_s: float


def _worker_env(rank: int, size: int, fd: int) -> dict[str, str]:
    env = dict(os.environ)
    # The workers import enc2dec from where this process did, as a spawned process would.
    path = [p or os.getcwd() for p in sys.path]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(path), ENC2DEC_TP_RANK=str(rank), ENC2DEC_TP_SIZE=str(size),
               ENC2DEC_TP_FD=str(fd), ENC2DEC_TP_PARENT=str(os.getpid()))
    return env


class WorkerPool:
    """Ranks 1..size-1: their processes, one socket each, and a watcher for deaths."""

    def __init__(self, size: int, start_timeout_s: float):
        self.size = size
        self.start_timeout_s = start_timeout_s    # a worker's imports, weight loading and graph capture
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, Connection] = {}
        self.errors: dict[int, str] = {}          # what a worker reported before exiting
        self._dead: WorkerDiedError | None = None
        self._stopping = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def start(self, spec: WorkerSpec) -> None:
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "enc2dec.engine.parallel.worker"],
                                    env=_worker_env(rank, self.size, theirs.fileno()), pass_fds=(theirs.fileno(),))
            theirs.close()
            self.procs[rank], self.conns[rank] = proc, Connection(ours.detach())
        self.send_all(("init", spec))
        self.wait_for("joining")     # a worker dead before the group forms would stall it

    def send_all(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(data)
            except OSError:
                raise self.death_error(DEATH_GRACE_S) or WorkerDiedError(
                    f"tensor-parallel worker {rank} closed its connection") from None

    def wait_for(self, kind: str) -> None:
        """Block until every worker has sent ``kind``; a worker's death or error raises."""
        timeout_s = self.start_timeout_s
        waiting, deadline = set(self.conns), time.monotonic() + timeout_s
        while waiting:
            ready = wait([self.conns[r] for r in waiting], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerDiedError(f"tensor-parallel workers {sorted(waiting)} did not report {kind!r} within "
                                      f"{timeout_s:.0f} s (tuning.tp_timeout_s)")
            for conn in ready:
                rank = next(r for r, c in self.conns.items() if c is conn)
                got, payload = self._recv(rank)
                if got == kind:
                    waiting.discard(rank)
                    continue
                if got == "error":
                    self.errors[rank] = payload
                raise self.death_error(DEATH_GRACE_S) or WorkerDiedError(
                    f"tensor-parallel worker {rank} sent {got!r} instead of {kind!r}: {payload or ''}")

    def _recv(self, rank: int):
        try:
            return pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            return "eof", None

    def watch(self, tp: TensorParallelGroup) -> None:
        """A thread that notices a worker's exit and aborts the group (unblocks NCCL)."""
        def run():
            while not self._stopping.wait(0.2):
                died = self._find_dead()
                if died is not None:
                    self._dead = died
                    tp.abort()
                    return
        threading.Thread(target=run, name="enc2dec-tp-watch", daemon=True).start()

    def _find_dead(self) -> WorkerDiedError | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                self._collect_error(rank)
                return WorkerDiedError(_describe_death(rank, code, self.errors.get(rank)))
        return None

    def _collect_error(self, rank: int) -> None:
        conn = self.conns.get(rank)
        try:
            while rank not in self.errors and conn is not None and conn.poll(0):
                kind, payload = pickle.loads(conn.recv_bytes())
                if kind == "error":
                    self.errors[rank] = payload
        except (EOFError, OSError, pickle.UnpicklingError):
            pass

    def death_error(self, grace_s: float = 0.0) -> WorkerDiedError | None:
        """The error for the first worker found dead, waiting up to ``grace_s`` for one to exit."""
        deadline = time.monotonic() + grace_s
        while True:
            died = self._dead or self._find_dead()
            if died is not None or time.monotonic() >= deadline:
                return died
            time.sleep(0.05)

    def raise_if_dead(self) -> None:
        died = self._dead or self._find_dead()
        if died is not None:
            raise died

    def stop(self, graceful: bool = True) -> None:
        """Ask every worker to exit (``graceful``), then terminate, then kill; close the sockets."""
        self._stopping.set()
        if graceful:
            try:
                self.send_all(("stop", None))
            except WorkerDiedError:
                pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in self.procs.values():
            for action in (None, proc.terminate, proc.kill):
                if action is not None:
                    action()
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()) if action is None else 5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def _describe_death(rank: int, code: int, error: str | None) -> str:
    how = f"exit code {code}"
    if code < 0:
        try:
            how += f", {signal.Signals(-code).name}"
        except ValueError:
            pass
    last = error.strip().splitlines()[-1] if error and error.strip() else ""
    return f"tensor-parallel worker {rank} died ({how})" + (f": {last}" if last else "")
