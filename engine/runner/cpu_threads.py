"""Keep the caller's thread free of an OpenMP thread pool on the CPU.

The engine steps on its own thread (``LLM``'s engine thread), while the weights load on the
thread that builds the ``LLM``. Under libgomp (PyTorch's OpenMP) every OS thread that runs a
parallel region keeps a pool of workers for the rest of its life, and once the process holds
more such threads than it has CPUs, every worker stops spinning between regions and sleeps
on a futex instead (libgomp's "throttled" spin count). A decode step is ~50 short parallel
regions (GEMVs, attention), so each then pays a futex wake-up: on 2 cores a flan-t5-small
decode step took 15-17 ms that way against 8-9 ms with one pool (measured 2026-12-02).

So on the CPU the model is built on a short-lived thread: its pool goes when it ends, and the
engine thread's pool is the only one. A caller that runs torch work on its own thread while
an engine steps (e.g. a transformers baseline in the same process) brings the throttling back;
that is libgomp's rule, not something this module can change.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


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
