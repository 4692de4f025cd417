"""Tensor parallelism, driver side: starts the worker processes and runs rank 0.

    driver process (rank 0)                         worker process r (1..N-1)
    LLM -> EngineCore -> Scheduler                  python -m enc2dec.engine.parallel.worker
    TensorParallelRunner.launch(so):
        send so (pickled, sampling state stripped) -->  WorkerRunner.launch(so)
        ModelRunner.launch(so)   <== all-reduces ==>    (same kernels, its own heads)
        sample, broadcast the tokens  ==============>  receive them as its next inputs

The worker processes are ``tp_pool.WorkerPool``'s; the collectives go through
``distributed.TensorParallelGroup``. The scheduler, the sampler and every request's state
live on the driver only.

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
import threading

import torch

from enc2dec.engine.core.batch import SchedulerOutput
from enc2dec.engine.parallel.distributed import (TensorParallelError, TensorParallelGroup, WorkerDiedError,
                          check_tensor_parallel, create_store, init_group, rank_device)
from enc2dec.engine.runner.model_runner import ModelRunner
from enc2dec.engine.runner.sampler import DeviceSample, Sampler
from enc2dec.engine.parallel.pool import DEATH_GRACE_S, WorkerPool, WorkerSpec

logger = logging.getLogger("enc2dec")

CLOSE_TIMEOUT_S = 10.0


def start_tensor_parallel(args, src, device: torch.device, dtype: torch.dtype, attn_backend: str,
                          max_input_len: int) -> "TensorParallelRunner":
    """Check the TP size, start ranks 1..N-1, then build rank 0 here; every rank loads its shard."""
    size = args.tensor_parallel_size
    check_tensor_parallel(src.hf_config, size, device)             # before any process or weight
    device = rank_device(device, 0)
    timeout_s = args.tuning.tp_timeout_s
    store = create_store(0, size, 0, timeout_s)
    spec = WorkerSpec(dataclasses.replace(args, tokenizer=None), src.hf_config, src.path, device, dtype,
                      attn_backend, max_input_len, src.feature_extractor, store.port, timeout_s)
    pool = WorkerPool(size, timeout_s)
    tp = None
    try:
        pool.start(spec)
        tp = init_group(0, size, store, device, timeout_s)
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
        """Graphs first, then the workers, then the communicator: NCCL's abort waits until every
        CUDA graph that captured one of the communicator's kernels is destroyed, so with graphs
        alive it never returns. The close stays bounded in case another resource holds it."""
        super().shutdown()
        self.pool.stop()
        closer = threading.Thread(target=self.tp.close, name="enc2dec-tp-close", daemon=True)
        closer.start()
        closer.join(CLOSE_TIMEOUT_S)
        if closer.is_alive():
            logger.warning("tensor parallel: the communicator did not close within %.0f s; leaving it to "
                           "process exit", CLOSE_TIMEOUT_S)


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

    def release(self, seq_ids) -> None:
        self.inner.release(seq_ids)

    def sample(self, logits, states, num_output_tokens, *beam_args) -> DeviceSample:
        try:
            out = self.inner.sample(logits, states, num_output_tokens, *beam_args)
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
