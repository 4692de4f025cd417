"""Tensor parallelism, driver side: starts the worker processes and runs rank 0.

    driver process (rank 0)                         worker process r (1..N-1)
    LLM -> EngineCore -> Scheduler                  python -m enc2dec.engine.tp_worker
    TensorParallelRunner.launch(so):
        send so (pickled, sampling state stripped) -->  WorkerRunner.launch(so)
        ModelRunner.launch(so)   <== all-reduces ==>    (same kernels, its own heads)
        sample, broadcast the tokens  ==============>  receive them as its next inputs

Each worker is a fresh interpreter (``sys.executable -m``, the spawn model: nothing is
inherited but the environment and ``sys.path``), talking to the driver over one socket
pair; the collectives go through ``distributed.TensorParallelGroup``. The scheduler, the
sampler and every request's state live on the driver only.

Failure model: a worker that exits (killed, or an exception it reports before exiting)
turns the driver's next collective into an error (gloo notices the closed socket at once;
for NCCL a watcher thread aborts the communicator), which surfaces as
``WorkerDiedError("tensor-parallel worker 1 died (exit code -9)")``. ``shutdown()`` stops
the workers (asking, then terminating, then killing). Workers exit by themselves when the
driver disappears. A step that fails on rank 0 alone fails only its requests if every
rank still completed it (sampling, the last collective, is always completed), and is
fatal (``TensorParallelError``) otherwise.
"""
from __future__ import annotations

import dataclasses
import logging
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

from .batch import SchedulerOutput
from .distributed import (DEFAULT_TIMEOUT_S, TensorParallelError, TensorParallelGroup, WorkerDiedError,
                          check_tensor_parallel, create_store, init_group, rank_device, set_nccl_env)
from .model_runner import ModelRunner
from .sampler import DeviceSample, Sampler

logger = logging.getLogger("enc2dec")

START_TIMEOUT_S = DEFAULT_TIMEOUT_S       # a worker's imports, weight loading and graph capture
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


def start_tensor_parallel(args, src, device: torch.device, dtype: torch.dtype, attn_backend: str,
                          max_input_len: int) -> "TensorParallelRunner":
    """Check the TP size, start ranks 1..N-1, then build rank 0 here; every rank loads its shard."""
    size = args.tensor_parallel_size
    check_tensor_parallel(src.hf_config, size, device)             # before any process or weight
    set_nccl_env()
    device = rank_device(device, 0)
    store = create_store(0, size, 0)
    spec = WorkerSpec(dataclasses.replace(args, tokenizer=None), src.hf_config, src.path, device, dtype,
                      attn_backend, max_input_len, src.feature_extractor, store.port, DEFAULT_TIMEOUT_S)
    pool = WorkerPool(size)
    tp = None
    try:
        pool.start(spec)
        tp = init_group(0, size, store, device)
        pool.watch(tp)
        runner = TensorParallelRunner(args, src.hf_config, src.path, device, dtype, attn_backend, max_input_len,
                                      src.feature_extractor, tp=tp, pool=pool)
        pool.wait_for("ready")
    except BaseException as e:
        # A ValueError is this rank's own verdict (e.g. a checkpoint that does not fit); any
        # other error may be a collective that failed because a worker went first.
        died = pool.death_error(0.0 if isinstance(e, ValueError) else DEATH_GRACE_S)
        pool.stop(graceful=False)          # workers may be blocked in a collective with us
        if tp is not None:
            tp.close()
        if died is not None:
            raise WorkerDiedError(f"{died} while starting") from e
        raise
    logger.info("tensor parallel: %d ranks (%s), worker pids %s", size,
                "nccl" if device.type == "cuda" else "gloo", ",".join(map(str, pool.pids)))
    return runner


class TensorParallelRunner(ModelRunner):
    """Rank 0: each step goes to the workers first, then runs here; tokens are sampled here
    and broadcast, so every rank feeds the same tokens next step."""

    def __init__(self, *args, pool: "WorkerPool", **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = pool
        self.sampler = _BroadcastingSampler(Sampler(), self.tp)

    @property
    def worker_pids(self) -> list[int]:
        return self.pool.pids

    def launch(self, so: SchedulerOutput):
        self.pool.raise_if_dead()
        message = _for_workers(so)
        self.sampler.is_synced = False
        try:
            self.pool.send_all(("step", message))
            pending = super().launch(so)
        except Exception as e:  # noqa: BLE001 - a dead peer shows up as any collective error
            if self.sampler.is_synced:    # e.g. a logits processor raised: every rank finished the step
                raise
            died = self.pool.death_error(DEATH_GRACE_S)
            if died is not None:
                raise died from e
            raise TensorParallelError(f"a tensor-parallel step failed on rank 0 before its collectives "
                                      f"completed, so the ranks are out of step: {type(e).__name__}: {e}") from e
        return _CheckedPendingStep(pending, self.pool)

    def shutdown(self) -> None:
        self.pool.stop()
        self.tp.close()


class _CheckedPendingStep:
    """A step's result is only trusted if every worker lived through it (an aborted NCCL
    communicator can let the wait return garbage rather than fail)."""

    def __init__(self, pending, pool: "WorkerPool"):
        self._pending, self._pool = pending, pool

    def wait(self):
        try:
            out = self._pending.wait()
        except Exception as e:  # noqa: BLE001
            died = self._pool.death_error(DEATH_GRACE_S)
            if died is not None:
                raise died from e
            raise
        self._pool.raise_if_dead()
        return out


class _BroadcastingSampler:
    """Samples on rank 0 and broadcasts the chosen ids (int64 [S], on the device). When
    sampling fails (a user's logits processor may raise) the workers, who wait for this
    step's ids, still get a broadcast: the step fails on rank 0 only, as on one GPU."""

    def __init__(self, inner: Sampler, tp: TensorParallelGroup):
        self.inner, self.tp = inner, tp
        self.is_synced = False        # this step's broadcast happened: the ranks are in step

    def sample(self, logits, states, num_output_tokens) -> DeviceSample:
        try:
            out = self.inner.sample(logits, states, num_output_tokens)
        except Exception:
            self.tp.broadcast_(torch.zeros(len(states), dtype=torch.long, device=logits.device))
            self.is_synced = True
            raise
        self.tp.broadcast_(out.token_ids.contiguous())
        self.is_synced = True
        return out


def _for_workers(so: SchedulerOutput) -> SchedulerOutput:
    """Workers never sample, so they get no sampling state (which may hold unpicklable
    logits processors)."""
    if not so.encodes:
        return so
    return dataclasses.replace(so, encodes=[dataclasses.replace(e, sampling_params=None) for e in so.encodes])


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

    def __init__(self, size: int):
        self.size = size
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
            proc = subprocess.Popen([sys.executable, "-m", "enc2dec.engine.tp_worker"],
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

    def wait_for(self, kind: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every worker has sent ``kind``; a worker's death or error raises."""
        waiting, deadline = set(self.conns), time.monotonic() + timeout_s
        while waiting:
            ready = wait([self.conns[r] for r in waiting], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerDiedError(f"tensor-parallel workers {sorted(waiting)} did not report {kind!r} within "
                                      f"{timeout_s:.0f} s (ENC2DEC_TP_TIMEOUT_S)")
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
