"""Keep the caller's thread free of an OpenMP thread pool on the CPU.

The engine steps on its own thread (``LLM``'s engine thread), while the weights load on the
thread that builds the ``LLM``. Under libgomp (PyTorch's OpenMP) every OS thread that runs a
parallel region keeps a pool of workers for the rest of its life, and once the process holds
more such threads than it has CPUs, every worker stops spinning between regions and sleeps
on a futex instead (libgomp's "throttled" spin count). A decode step is ~50 short parallel
regions (GEMVs, attention), so each then pays a futex wake-up: on 2 cores a flan-t5-small
decode step took 15-17 ms that way against 8-9 ms with one pool (measured 2026-12-02).

So on the CPU the model is built on a short-lived thread: its pool goes when it ends, and the
engine thread's pool is the only one. A caller's thread that ran torch work before (loading
audio, a transformers baseline, anything parallel) still holds a pool for the rest of its life;
``release_thread_pool`` frees it (OpenMP 5's ``omp_pause_resource_all``, which frees the calling
thread's pool), and the CPU engine calls it on a caller's thread that is about to block on it
(``LLM.generate``, ``RequestHandle.result``): measured 2026-12-05 on 2 cores, a flan-t5-small
decode step took 16.4 ms on the engine thread after the caller had run one parallel op, 9.7-10.2
ms when it had not or had released its pool. A caller that runs torch work *while* the engine
steps still brings the throttling back for that time: two pools are then busy at once, which is
libgomp's rule.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1     # omp_pause_soft: free the pool's threads, keep the runtime


@functools.lru_cache(maxsize=1)
def _find_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp torch runs on, found among the loaded libraries
    (/proc/self/maps): the copy inside torch's package (its wheels bundle one), else a system one
    (source builds). Other wheels vendor libgomp copies of their own (sentencepiece's
    ``sentencepiece.libs/libgomp-*.so``): pausing one of those frees nothing of torch's. Only
    libgomp: its soft pause frees just the calling thread's pool, which is what was measured."""
    import torch

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:                         # not Linux
        return None
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    ours = [p for p in paths if os.path.realpath(p).startswith(torch_dir)]
    system = [p for p in paths if ".libs" + os.sep not in p and p not in ours]    # not a wheel's vendored copy
    for path in sorted(ours) or sorted(system):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all      # already loaded: the same library
        except (OSError, AttributeError):   # gone, or a libgomp older than OpenMP 5 (GCC 9)
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_thread_pool() -> None:
    """Free the calling thread's OpenMP worker pool if it has one (about 0.2 ms; 1 us when it has
    none), so that it no longer counts against the engine thread's pool. Torch work on this
    thread later builds a new one. A no-op where the runtime is not libgomp."""
    pause_all = _find_pause()
    if pause_all is not None:
        pause_all(_OMP_PAUSE_SOFT)


def on_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a new thread that ends before this returns; its exception is re-raised here."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=target, name="enc2dec-cpu-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
