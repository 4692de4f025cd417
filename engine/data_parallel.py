"""Data parallelism on one host: N engine replicas behind one front, with the ``LLM`` surface.

``LLM(model, data_parallel_size=N)`` (``--dp-size N``) returns a ``DataParallelLLM``. Each
replica is a ``ProcessLLM``: a whole engine (its own weights, KV cache and step loop) in its
own spawned process. On CUDA, replica i sees only the i-th group of ``tensor_parallel_size``
visible GPUs (``CUDA_VISIBLE_DEVICES``, which its TP workers inherit); on the CPU each gets
``cores // N`` torch threads.

Routing: a new request goes to the live replica with the fewest decoder sequences in flight
(queued or running), least recently used on a tie. The count is the front's own: the
sequences it routed to the replica whose final output has not come back yet. Every request
of a replica passes through here, so that is the replica's queued + running count; the
per-step stats the children send would miss what is still in the pipe, so a burst arriving
between two steps would pile onto one replica. A request stays on its replica: its handle
talks to that replica only (streaming, abort).

A replica whose process dies fails its own pending requests (``ProcessLLM`` does that);
new requests go to the others, and the front stays healthy while one replica lives.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
from typing import Any

from enc2dec.engine.config import LlmArgs
from enc2dec.engine.engine_process import EngineProcessError, ProcessLLM
from enc2dec.engine.lifecycle import ShutdownOnExit


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one replica runs: what its process is called, its environment, its torch threads."""

    name: str
    env: dict
    num_threads: int | None


def placements(args: LlmArgs) -> list[Placement]:
    """One ``Placement`` per replica; a ValueError when the machine has too few GPUs."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    device = str(args.device)
    num_gpus = 0
    if device != "cpu":
        import torch

        num_gpus = torch.cuda.device_count()     # NVML where it can: the parent never initialises CUDA
        if device == "cuda" and num_gpus == 0:
            raise ValueError(f"device={device!r} was asked for but no CUDA GPU is visible; use device='cpu'")
    if num_gpus == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // dp)
        # OMP_NUM_THREADS too, so the replica's own TP workers split its share, not the machine.
        return [Placement(f"engine process of replica {i} (cpu, {threads} thread{'s' if threads > 1 else ''})",
                          {"OMP_NUM_THREADS": str(threads)}, threads) for i in range(dp)]
    if dp * tp > num_gpus:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs, but "
                         f"{num_gpus} {'is' if num_gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")][:num_gpus] if visible else [str(i) for i in range(num_gpus)]
    out = []
    for i in range(dp):
        group = ",".join(ids[i * tp:(i + 1) * tp])
        out.append(Placement(f"engine process of replica {i} (GPU {group})", {"CUDA_VISIBLE_DEVICES": group}, None))
    return out


def replica_kv_config(kvc, places: list[Placement], available: int | None = None):
    """Each replica's ``kv_cache_config``: CPU replicas share one machine's memory, so an unset
    ``max_cpu_memory_bytes`` becomes each one's part of the one automatic budget (a replica
    sizing its own would take a quarter of what is free, N times over)."""
    if places[0].num_threads is None or kvc.max_cpu_memory_bytes is not None:
        return kvc
    from enc2dec.engine.core.kv_sizing import auto_cpu_kv_budget

    return dataclasses.replace(kvc, max_cpu_memory_bytes=max(1, auto_cpu_kv_budget(available) // len(places)))


def _num_seqs(params) -> int:
    """Decoder sequences a request occupies: its samples or beams."""
    if params is None:
        return 1
    return max(1, getattr(params, "best_of", None) or getattr(params, "n", 1) or 1)


class _Replica:
    """One engine process and the front's count of what it holds."""

    def __init__(self, index: int, llm: ProcessLLM):
        self.index, self.llm = index, llm
        self.num_routed = 0                      # requests admitted here since start (for metrics)
        self.num_pending_seqs = 0                # routed here, the replica has not yet said it took them
        self.last_routed = -1                    # routing order of the latest one: least recently used wins a tie
        self._in_flight: dict[str, tuple[Any, int]] = {}   # request id -> (handle, decoder sequences)

    def load(self) -> int:
        """Decoder sequences routed here and not finished (drops the finished ones first)."""
        done = [rid for rid, (h, _) in self._in_flight.items() if h.done()]
        for rid in done:
            del self._in_flight[rid]
        return self.num_pending_seqs + sum(n for _, n in self._in_flight.values())

    def track(self, handles, seqs: list[int]) -> None:
        for h, n in zip(handles, seqs):
            self._in_flight[h.request_id] = (h, n)
        self.num_routed += len(handles)


class DataParallelLLM(ShutdownOnExit):
    """``LLM`` over ``data_parallel_size`` engine processes (see the module docstring)."""

    def __init__(self, args: LlmArgs):
        self.args = args
        replica_args = dataclasses.replace(args, data_parallel_size=1, engine_process=True)
        places = placements(args)
        replica_args = dataclasses.replace(replica_args, kv_cache_config=replica_kv_config(args.kv_cache_config, places))
        self._stop = False
        self._lock = threading.Lock()            # routing: the in-flight counts and the choice
        self._order = itertools.count()
        # Replicas load side by side: each reads the checkpoint and sizes its own KV cache.
        with concurrent.futures.ThreadPoolExecutor(len(places), thread_name_prefix="enc2dec-dp-start") as pool:
            futures = [pool.submit(ProcessLLM, replica_args, env=p.env, num_threads=p.num_threads, name=p.name)
                       for p in places]
            concurrent.futures.wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for llm in started:
                llm.shutdown()
            raise failed[0]                      # as one engine would have failed (same type, same message)
        self._replicas = [_Replica(i, llm) for i, llm in enumerate(started)]

    @classmethod
    def from_args(cls, args: LlmArgs) -> "DataParallelLLM":
        return cls(args)

    # ---- what every replica shares -------------------------------------------------------------
    @property
    def replicas(self) -> list[ProcessLLM]:
        return [r.llm for r in self._replicas]

    @property
    def tokenizer(self):
        return self._replicas[0].llm.tokenizer

    @property
    def engine(self):
        """Replica 0's start-up snapshot (config, processor, limits): the same for all replicas."""
        return self._replicas[0].llm.engine

    @property
    def model_info(self) -> dict:
        return {**self._replicas[0].llm.model_info, "data_parallel_size": len(self._replicas)}

    # ---- health and counters --------------------------------------------------------------------
    def _live(self) -> list[_Replica]:
        return [r for r in self._replicas if r.llm.is_healthy]

    @property
    def is_healthy(self) -> bool:
        """True while at least one replica lives (``replica_health`` says which)."""
        return not self._stop and bool(self._live())

    @property
    def error(self) -> BaseException | None:
        """None while a replica lives; once every one has died, an error naming each death."""
        if self._stop or self._live():
            return None
        return EngineProcessError("every replica has died: " + "; ".join(
            f"replica {r.index}: {r.llm.error}" for r in self._replicas))

    def replica_health(self) -> list[dict]:
        """Per replica: index, status (ok, failed, shut down), process id, and the error of a dead one."""
        out = []
        for r in self._replicas:
            llm = r.llm
            status = "ok" if llm.is_healthy else ("shut down" if self._stop else "failed")
            entry = {"replica": r.index, "status": status, "pid": llm.pid}
            if status == "failed":
                entry["error"] = str(llm.error or "the engine process exited")
            out.append(entry)
        return out

    def stats(self) -> dict:
        """The live replicas' counters summed (a dead one holds nothing), and ``replicas``: each
        replica's own, with its health and the requests routed to it."""
        live, per = [], []
        for r in self._replicas:
            s, healthy = r.llm.stats(), r.llm.is_healthy
            per.append({**s, "replica": r.index, "healthy": healthy, "routed": r.num_routed})
            if healthy:
                live.append(s)
        total = {key: sum(s.get(key, 0) for s in live) for key in ("waiting", "running", "running_seqs")}
        kv = {}
        for pool in ("self", "cross"):
            usages = [s["kv"][pool] for s in live]
            # The replicas' peaks come at different moments: their sum bounds the total's peak.
            kv[pool] = {"used_blocks": sum(u["used_blocks"] for u in usages),
                        "peak_used_blocks": sum(u.get("peak_used_blocks", 0) for u in usages),
                        "total_blocks": sum(u["total_blocks"] for u in usages),
                        "tokens_per_block": self._replicas[0].llm.stats()["kv"][pool]["tokens_per_block"]}
        # Summed, the step counters give the replicas' mean step time and rows per step.
        steps = {key: sum(s["steps"][key] for s in live) for key in live[0]["steps"]} if live else {}
        return {**total, "kv": kv, "steps": steps, "replicas": per}

    def kv_cache_usage(self) -> dict[str, dict[str, int]]:
        return self.stats()["kv"]

    def reset_kv_peaks(self) -> None:
        for r in self._live():
            r.llm.reset_kv_peaks()

    def queue_stats(self) -> dict[str, int]:
        s = self.stats()
        return {"waiting": s["waiting"], "running": s["running"]}

    # ---- requests ---------------------------------------------------------------------------------
    def _check_open(self) -> list[_Replica]:
        if self._stop:
            raise RuntimeError("the LLM has been shut down")
        live = self._live()
        if not live:
            raise RuntimeError(str(self.error))
        return live

    def _assign(self, positions: list[int], seqs: list[int], exclude: set[int]) -> dict[int, list[int]]:
        """Replica index -> the ``positions`` it gets: each to the least loaded live replica, as if
        the ones before it had been sent already; their sequences count as pending there until
        the replica admits them. Caller holds ``_lock``."""
        live = [r for r in self._check_open() if r.index not in exclude]
        if not live:
            raise RuntimeError("every replica that could take the request has died")
        load = {r.index: r.load() for r in live}
        plan: dict[int, list[int]] = {}
        for p in positions:
            best = min(live, key=lambda r: (load[r.index], r.last_routed))
            plan.setdefault(best.index, []).append(p)
            load[best.index] += seqs[p]
            best.last_routed = next(self._order)
        for i, ps in plan.items():
            self._replicas[i].num_pending_seqs += sum(seqs[p] for p in ps)
        return plan

    def _send(self, batch: list[tuple], single: bool) -> list:
        """Handles for ``batch`` ((inputs, params, streaming) each), in its order, spread over the
        replicas. All are admitted or none (a bad prompt aborts those already in); a replica
        that dies while taking its share hands it to the others."""
        seqs = [_num_seqs(params) for _, params, _ in batch]
        handles: list = [None] * len(batch)
        todo, exclude = list(range(len(batch))), set()
        try:
            while todo:
                with self._lock:
                    plan = self._assign(todo, seqs, exclude)
                todo = []
                for i, positions in sorted(plan.items()):
                    replica, got = self._replicas[i], None
                    try:
                        got = replica.llm._add([batch[p] for p in positions], single, indices=positions)
                    except RuntimeError:                   # shut down or died (a ValueError is the caller's)
                        if replica.llm.is_healthy:
                            raise
                        exclude.add(i)
                        todo.extend(positions)
                    finally:
                        with self._lock:
                            replica.num_pending_seqs -= sum(seqs[p] for p in positions)
                            if got is not None:
                                replica.track(got, [seqs[p] for p in positions])
                    for p, h in zip(positions, got or ()):
                        handles[p] = h
                todo.sort()
        except BaseException:
            for h in handles:
                if h is not None and not h.done():
                    h.abort()
            raise
        return handles

    def generate(self, inputs, sampling_params=None, use_tqdm: bool = True):
        from enc2dec.engine.llm import batch_of, wait_all

        single, prompts, params = batch_of(inputs, sampling_params)
        handles = self._send([(p, sp, False) for p, sp in zip(prompts, params)], single)
        results = wait_all(handles, use_tqdm and len(handles) > 1)
        for h, out in zip(handles, results):
            if out.error and h._llm.error is not None:    # its replica died under it
                raise RuntimeError(str(h._llm.error)) from h._llm.error
        return results[0] if single else results

    def generate_async(self, inputs, sampling_params=None, streaming: bool = False):
        return self._send([(inputs, sampling_params, streaming)], True)[0]

    def call_on_engine(self, fn) -> concurrent.futures.Future:
        """``fn(engine_core)`` in one replica's engine process, the least loaded live one: for work
        that reads the loaded model (Whisper's word alignment), which every replica holds alike.
        ``fn`` must pickle, as with ``ProcessLLM``."""
        with self._lock:
            live = self._check_open()
            replica = min(live, key=lambda r: (r.load(), r.last_routed))
        return replica.llm.call_on_engine(fn)

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        threads = [threading.Thread(target=r.llm.shutdown, name=f"enc2dec-dp-stop-{r.index}")
                   for r in self._replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
