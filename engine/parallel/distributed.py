"""Tensor parallelism's process group and its checks.

Every rank holds one ``TensorParallelGroup``: its rank, the group size and a
``torch.distributed`` backend object (``ProcessGroupNCCL`` on GPUs, ``ProcessGroupGloo``
on the CPU) built directly on a ``TCPStore``. No default process group is created, so an
``LLM`` with ``tensor_parallel_size > 1`` neither needs nor disturbs a user's own
``torch.distributed`` setup, and several can live (one after another) in one process.

Models see only three operations: ``split`` (this rank's share of a dimension),
``narrow`` (this rank's slice of a checkpoint tensor) and ``all_reduce_``. A group of
size 1 (``SINGLE``) makes all three no-ops, so the single-GPU path is unchanged.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

# NVLink SHARP (multicast) off for NCCL: the machines this runs on cannot use it and NCCL
# would otherwise probe it at communicator creation.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def set_nccl_env() -> None:
    """Put ``NCCL_ENV`` into this process's environment. NCCL reads its settings only from
    the environment of the process that creates the communicator, when it creates it, so
    ``init_group`` calls this there (the driver is rank 0 and runs NCCL itself); no other
    process's environment is touched, and a CPU (gloo) group touches none."""
    os.environ.update(NCCL_ENV)


class TensorParallelError(RuntimeError):
    """The ranks can no longer run steps together: fatal for the engine."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process exited."""


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    backend: Any = None          # torch.distributed Backend; None when size == 1
    store: Any = None            # the TCPStore the backend was built on (kept alive with it)

    def split(self, n: int, what: str = "dimension") -> int:
        """This rank's share of ``n`` (heads, intermediate units); ``n`` must divide evenly."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the {what} ({n})")
        return n // self.size

    def narrow(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of a full (checkpoint) tensor along ``dim``."""
        if self.size == 1:
            return t
        n = self.split(t.shape[dim], f"checkpoint dimension {dim} of shape {tuple(t.shape)}")
        return t.narrow(dim, self.rank * n, n)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks (captured into CUDA graphs like any NCCL kernel)."""
        if self.size > 1:
            self.backend.allreduce([t]).wait()
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            from torch.distributed import BroadcastOptions

            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            self.backend.broadcast([t], opts).wait()
        return t

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (a start-up agreement, e.g. the KV budget)."""
        if self.size == 1:
            return value
        from torch.distributed import AllreduceOptions, ReduceOp

        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self.backend.allreduce([t], opts).wait()
        return int(t.item())

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (NCCL); gloo fails on its own."""
        fn = getattr(self.backend, "abort", None)
        if fn is not None and _is_nccl(self.backend):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass

    def close(self) -> None:
        """Release the communicator without waiting on peers (which may already be gone):
        an NCCL abort; gloo closes its sockets when the backend is dropped."""
        self.abort()


SINGLE = TensorParallelGroup()


def _is_nccl(backend) -> bool:
    return type(backend).__name__ == "ProcessGroupNCCL"


def create_store(rank: int, size: int, port: int, timeout_s: float):
    """Rank 0 hosts the store (``port=0`` picks a free port: read ``store.port``). A collective
    that waits longer than ``timeout_s`` (``tuning.tp_timeout_s``) raises (gloo) or is aborted
    by NCCL's watchdog: the backstop for a rank that hangs without dying."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def init_group(rank: int, size: int, store, device: torch.device, timeout_s: float) -> TensorParallelGroup:
    """Join the group (blocks until every rank has joined, for gloo)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        set_nccl_env()
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        backend = dist.ProcessGroupGloo(store, rank, size, opts)
    return TensorParallelGroup(rank, size, backend, store)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """GPU rank r runs on cuda:r; CPU ranks all run on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _sharded_sizes(hf_config) -> dict[str, int]:
    """The dimensions a tensor-parallel model splits: every attention's heads and every MLP's
    intermediate size."""
    c = hf_config
    if c.model_type == "t5":
        return {"encoder attention heads": c.num_heads, "decoder attention heads": c.num_heads,
                "cross-attention heads": c.num_heads, "feed-forward size (d_ff)": c.d_ff}
    return {"encoder attention heads": c.encoder_attention_heads,
            "decoder attention heads": c.decoder_attention_heads,
            "cross-attention heads": c.decoder_attention_heads,
            "encoder feed-forward size": c.encoder_ffn_dim, "decoder feed-forward size": c.decoder_ffn_dim}


def check_tensor_parallel(hf_config, tp_size: int, device: torch.device) -> None:
    """Raise ``ValueError`` for a TP size the model or the machine cannot run, before any
    weights load or worker starts."""
    if tp_size == 1:
        return
    sizes = _sharded_sizes(hf_config)
    bad = {name: n for name, n in sizes.items() if n % tp_size}
    if bad:
        valid = [d for d in range(1, min(sizes.values()) + 1) if all(n % d == 0 for n in sizes.values())]
        what = ", ".join(f"{name} {n}" for name, n in bad.items())
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the {what} of "
                         f"{hf_config.model_type}: heads and feed-forward units are split evenly across "
                         f"ranks; valid sizes for this model: {', '.join(map(str, valid))}")
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"device={device} with tensor_parallel_size={tp_size}: rank r always runs on "
                             "cuda:r; choose the GPUs with CUDA_VISIBLE_DEVICES and use device='cuda'")
        visible = torch.cuda.device_count()
        if tp_size > visible:
            raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, but {visible} "
                             f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
