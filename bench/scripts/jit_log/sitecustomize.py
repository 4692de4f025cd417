"""Log every Triton JIT compile, CUDA graph capture, long garbage collection and slow engine step
of a process, with wall times, to $JIT_LOG; for a step still running after $STALL_MS (default
150) ms, the stack of the thread running it, every 100 ms while it lasts.

    PYTHONPATH=bench/scripts/jit_log JIT_LOG=/tmp/jit.log enc2dec bench ...

A lab tool for mid-run stalls: a kernel variant compiled at its first use inside a measured run
(a new specialisation of an integer argument, a path the warm-up never took) costs the whole
batch a few hundred milliseconds a kernel. Each line: seconds since the process started, the
event, its duration for ends, and the kernel with its specialisation key.
"""
import os
import threading
import time

_T0 = time.perf_counter()
_PATH = os.environ.get("JIT_LOG")
_lock = threading.Lock()
_starts: dict = {}


def _write(line: str) -> None:
    with _lock, open(_PATH, "a") as f:
        f.write(f"{time.perf_counter() - _T0:9.3f} {os.getpid()} {line}\n")


def _install() -> None:
    try:
        from triton import knobs
    except Exception:
        return

    def before(**kw):
        name, key = kw["fn"].name, str(kw["key"])
        _starts[(name, key)] = time.perf_counter()
        _write(f"compile-start {name} {key[:300]}")
        return False                     # go on compiling

    def after(**kw):
        name, key = kw["fn"].name, str(kw["key"])
        t = _starts.pop((name, key), None)
        took = "" if t is None else f"{(time.perf_counter() - t) * 1e3:.0f}ms"
        _write(f"compile-end {took} {name}")

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after

    try:
        import torch
        real = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(self, *a, **k):
            _write("graph-capture")
            return real(self, *a, **k)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
    except Exception:
        pass


def _alloc_counts() -> str:
    """The CUDA caching allocator's cudaMalloc calls and out-of-memory retries so far."""
    try:
        import torch
        st = torch.cuda.memory_stats()
        return (f"device_allocs {st.get('num_device_alloc')} alloc_retries {st.get('num_alloc_retries')} "
                f"reserved_gib {st.get('reserved_bytes.all.current', 0) / 2**30:.1f}")
    except Exception as e:                      # no CUDA, or torch not imported yet
        return f"({type(e).__name__})"


def _watch_steps() -> None:
    """Wrap EngineCore.step once the engine module is imported; a watchdog dumps a slow step's stack."""
    import sys
    import traceback

    limit = float(os.environ.get("STALL_MS", "150")) / 1e3
    running: dict = {}

    def wrap(cls):
        real = cls.step

        def step(self, *a, **k):
            t = time.perf_counter()
            running["t"], running["ident"] = t, threading.get_ident()
            try:
                return real(self, *a, **k)
            finally:
                running.pop("t", None)
                took = time.perf_counter() - t
                if took > limit:
                    _write(f"slow-step {took * 1e3:.0f}ms {_alloc_counts()}")

        cls.step = step

    while "enc2dec.engine.engine_core" not in sys.modules or \
            not hasattr(sys.modules["enc2dec.engine.engine_core"], "EngineCore"):
        time.sleep(0.02)
    wrap(sys.modules["enc2dec.engine.engine_core"].EngineCore)
    last_dump = 0.0
    while True:
        time.sleep(0.02)
        t = running.get("t")
        now = time.perf_counter()
        if t is not None and now - t > limit and now - last_dump > 0.1:
            frame = sys._current_frames().get(running.get("ident"))
            if frame is not None:
                _write(f"stall-alloc {_alloc_counts()}")
                stack = "".join(traceback.format_stack(frame)[-12:]).replace("\n", " | ")
                _write(f"stall {(now - t) * 1e3:.0f}ms in step: {stack}")
                last_dump = now


def _watch_gc() -> None:
    import gc

    start = {}

    def cb(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        elif "t" in start:
            took = time.perf_counter() - start.pop("t")
            if took > 0.01:
                _write(f"gc gen{info.get('generation')} {took * 1e3:.0f}ms collected {info.get('collected')} "
                       f"frozen {gc.get_freeze_count()} tracked {len(gc.get_objects())}")

    gc.callbacks.append(cb)


if _PATH:
    _install()
    _watch_gc()
    threading.Thread(target=_watch_steps, daemon=True, name="stall-watch").start()
