"""A tensor-parallel worker process (ranks 1..N-1): ``python -m enc2dec.engine.parallel.worker``.

Started by ``tensor_parallel.WorkerPool`` with its rank and the file descriptor of its
socket to the driver in the environment. It builds its shard of the model and then runs
every step the driver sends, in order. It never samples: the tokens of each step arrive
by broadcast from rank 0 and become its next inputs, exactly as on the driver.

Messages (pickled tuples): driver -> worker ``("init", WorkerSpec)``, ``("step",
SchedulerOutput)``, ``("stop", None)``; worker -> driver ``("joining", None)``,
``("ready", None)``, ``("error", traceback text)`` just before exiting with code 1.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch

from enc2dec.engine.parallel.distributed import TensorParallelGroup, create_store, init_group, rank_device
from enc2dec.engine.runner.model_runner import ModelRunner
from enc2dec.engine.runner.sampler import DeviceSample


class WorkerRunner(ModelRunner):
    """Rank r > 0: the driver's steps without their sampling state."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampler = _ReceivingSampler(self.tp)

    def _register(self, encodes) -> None:
        for enc in encodes:
            self.states.setdefault(enc.request_id, dict.fromkeys(enc.seq_ids))


class _ReceivingSampler:
    """Takes rank 0's choices (int64 [S], on the device) instead of sampling."""

    def __init__(self, tp: TensorParallelGroup):
        self.tp = tp

    def release(self, seq_ids) -> None:
        pass                      # rank 0 keeps the histories

    def sample(self, logits, states, num_output_tokens, *beam_args) -> DeviceSample:
        # Beam candidates are chosen on rank 0; their forks reach this rank as block copies
        # and real input tokens in the next SchedulerOutput.
        token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
        return DeviceSample(self.tp.broadcast_(token_ids, src=0), [None] * len(states))


def _exit_with_parent(parent_pid: int) -> None:
    """No orphans: a driver killed without shutting down takes its workers with it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def _send(conn: Connection, kind: str, payload=None) -> None:
    conn.send_bytes(pickle.dumps((kind, payload)))


def serve(conn: Connection, rank: int, size: int) -> None:
    kind, spec = pickle.loads(conn.recv_bytes())
    assert kind == "init", kind
    device = rank_device(spec.device, rank)
    if device.type == "cpu":        # N ranks share the cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    torch.manual_seed(spec.args.seed)
    _send(conn, "joining")
    tp = init_group(rank, size, create_store(rank, size, spec.store_port, spec.timeout_s), device, spec.timeout_s)
    runner = WorkerRunner(spec.args, spec.hf_config, spec.model_path, device, spec.dtype, spec.attn_backend,
                          spec.max_input_len, spec.feature_extractor, tp=tp)
    _send(conn, "ready")
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "stop":
            return                   # main() exits at once: no communicator teardown with peers
        runner.launch(payload)


def main() -> None:
    rank, size = int(os.environ["ENC2DEC_TP_RANK"]), int(os.environ["ENC2DEC_TP_SIZE"])
    conn = Connection(int(os.environ["ENC2DEC_TP_FD"]))
    threading.Thread(target=_exit_with_parent, args=(int(os.environ["ENC2DEC_TP_PARENT"]),), daemon=True).start()
    logging.getLogger("enc2dec").setLevel(logging.ERROR)     # rank 0 logs for the group
    try:
        serve(conn, rank, size)
    except (EOFError, ConnectionError):
        os._exit(0)                  # the driver went away: nothing to report to
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        traceback.print_exc()
        sys.stderr.flush()
        try:
            _send(conn, "error", traceback.format_exc())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
