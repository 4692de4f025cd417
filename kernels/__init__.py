"""Triton kernels for the GPU path, each with a pure-torch reference in ``reference.py``.

Importing this package (or any kernel module) needs no Triton: kernels are decorated on
first launch (``lazy_jit``), so ``TRITON_INTERPRET`` is read when the first kernel runs, and
every public op falls back to its torch reference when Triton cannot run the tensor it got
(no Triton installed, or a CPU tensor without ``TRITON_INTERPRET=1``).

Public ops (each has a ``*_ref`` twin with the same signature in ``reference.py``):

    paged_attention, store_kv, fused_add_rms_norm, fused_add_layer_norm, gelu, gated_gelu,
    skinny_linear, gumbel_race, filtered_race
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

_LAZY = {
    "paged_attention": "paged_attention",
    "store_kv": "kv_store",
    "fused_add_rms_norm": "norms",
    "fused_add_layer_norm": "norms",
    "gelu": "activations",
    "gated_gelu": "activations",
    "skinny_linear": "skinny_gemm",
    "gumbel_race": "sampling",
    "filtered_race": "sampling",
    "TritonAttentionBackend": "backend",
}

__all__ = [  # noqa: PLE0604  (names of the lazily imported ops)
    "triton_available", "can_use_triton", "lazy_jit", *_LAZY.keys(),
]


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it need not have a GPU)."""
    try:
        importlib.import_module("triton.language")
    except (ImportError, OSError, RuntimeError):  # absent or broken: the torch references take over
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on these tensors (else use the reference)."""
    # Devices first: a CPU run without the interpreter never imports triton, so a later
    # TRITON_INTERPRET=1 (the kernel tests) still finds it unimported.
    on_cuda = all(t.is_cuda for t in tensors)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    return (on_cuda or (on_cpu and interpreting())) and triton_available()


_PDL = {"on": False}


def set_programmatic_launch(on: bool) -> None:
    """Launch the kernels here with programmatic dependent launch (PDL, Hopper and later): each
    kernel waits first (``griddepcontrol.wait``) for the memory of the kernel before it on the
    stream, then lets the kernel after it launch (``griddepcontrol.launch_dependents``), which
    then runs up to its own wait while this one works. What it saves is a launch's latency
    between two dependent kernels, which a decode step of a few hundred small kernels pays each
    time; the skinny GEMV also prefetches its weights before its wait. A kernel after a library
    one (cuBLAS: no PDL) launches when that one's blocks exit, as before. Process-wide
    (``tuning.programmatic_launch``)."""
    _PDL["on"] = bool(on)


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def programmatic_launch_on(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` launch programmatically (on, and a Hopper or later GPU)."""
    return _PDL["on"] and device.type == "cuda" and not interpreting() and _hopper_or_later(device.index or 0)


def launch_options(t: torch.Tensor) -> dict:
    """The keyword arguments that make a kernel launch on ``t``'s device programmatic, when it is
    on (``set_programmatic_launch``) and the device can: ``PDL``, the kernel's constexpr that
    puts the wait first, and Triton's ``launch_pdl``. Never under the interpreter."""
    if programmatic_launch_on(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


class lazy_jit:
    """``triton.jit`` applied at first launch, so a kernel module imports without Triton and
    ``TRITON_INTERPRET`` is read then, not at import.

    The kernel's module keeps ``tl = None`` as a placeholder and writes its annotations as
    strings (``from __future__ import annotations``); the first launch binds ``tl`` to
    ``triton.language``. A kernel may call device functions marked ``@lazy_jit.helper`` that
    its module defines or imports from another kernel module (the first launch jits them too),
    and no other jit functions.
    """

    class helper:
        """A device function for the ``lazy_jit`` kernels of its module."""

        def __init__(self, fn):
            self.fn = fn

    def __init__(self, fn=None, *, do_not_specialize: tuple[str, ...] = ()):
        # ``lazy_jit(do_not_specialize=(...))`` names integer arguments that change from launch
        # to launch (Triton otherwise compiles a variant for 1 and for multiples of 16)
        self.do_not_specialize = do_not_specialize
        self._kernel = None
        self.fn = fn
        if fn is not None:
            functools.update_wrapper(self, fn)

    def __call__(self, fn):
        # the decorator form with options: @lazy_jit(do_not_specialize=(...))
        return lazy_jit(fn, do_not_specialize=self.do_not_specialize)

    def __getitem__(self, grid):
        return self.jitted()[grid]

    def jitted(self):
        """The ``triton.jit`` kernel, made at the first call: binds ``tl`` and jits the helpers its
        module holds (``tests/kernel_aot.py`` compiles it for a GPU target from here)."""
        if self._kernel is None:
            import triton
            import triton.language as tl

            if interpreting():
                _check_interpreter_mode(tl)
                _patch_interpreter_index()
                _patch_interpreter_downcasts(tl)
                _patch_interpreter_bf16_dot(tl)
            module = self.fn.__globals__
            module["tl"] = tl
            for name, value in list(module.items()):
                if isinstance(value, lazy_jit.helper):
                    value.fn.__globals__["tl"] = tl      # a helper imported from another kernel module
                    module[name] = triton.jit(value.fn)
            self._kernel = triton.jit(self.fn, do_not_specialize=list(self.do_not_specialize) or None)
        return self._kernel


tl = None  # triton.language, bound when a kernel that calls the helper below is first launched


@lazy_jit.helper
def wait_for_previous_kernel():
    # A programmatically launched kernel's first step (``set_programmatic_launch``): wait for the
    # memory of the kernel before it, then let the kernel after it launch and wait in turn.
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


def _check_interpreter_mode(tl) -> None:
    # triton.language's own jit helpers (tl.sum, tl.cdiv, ...) are fixed at its import.
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.sum, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; "  # noqa: TRY004
                           "set it before the first `import triton` (e.g. at the top of the test module)")


@functools.cache
def _patch_interpreter_index() -> None:
    """Let triton<=3.6's CPU interpreter run loops with runtime bounds under NumPy >= 2.4.

    Its ``tensor.__index__`` calls ``int()`` on a one-element array, which NumPy 2.4 made
    an error (triton-lang/triton#9171, fixed upstream after 3.6). Only ever applied in
    interpreter mode; a fixed triton is left alone.
    """
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or "int(self.handle.data)" not in inspect.getsource(original):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


@functools.cache
def _patch_interpreter_downcasts(tl) -> None:
    """Let triton<=3.6's CPU interpreter round float32 -> float8 e4m3 and -> bfloat16 as the GPU
    does (to nearest, ties to even).

    Its ``_convert_float`` adds the rounding bit to e4m3's 3-bit mantissa without carrying into
    the exponent, so e.g. 127.9 becomes 64 instead of 128 (seen with the FP8 KV store kernel), and
    truncates to bfloat16 (4.1797 becomes 4.15625, not 4.1875: a fused norm's input then drifts
    from the separate kernel's). Each downcast is delegated to torch's conversion, which rounds to
    nearest even; only where the interpreter's own conversion is found wrong.
    """
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original = interpreter._convert_float
    # (a plain ``.to(tl.bfloat16)`` reaches it with no rounding mode; float8 casts name theirs)
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.array([127.9, -0.3], dtype=np.float32),
                               ir.ROUNDING_MODE.RTNE),
               tl.bfloat16: (torch.bfloat16, torch.int16, np.array([4.1796875, -0.3], dtype=np.float32), None)}
    wrong = {}
    for tl_dtype, (dtype, bits, probe, mode) in targets.items():
        expected = torch.from_numpy(probe).to(dtype).view(bits).numpy()
        got = original(probe, tl.float32, tl_dtype, mode).view(expected.dtype)
        if not np.array_equal(got, expected):
            wrong[tl_dtype] = (dtype, bits)
    if not wrong:
        return

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        # only to-nearest-even casts (the default; an explicit round-toward-zero stays the interpreter's)
        if input_dtype == tl.float32 and output_dtype in wrong and rounding_mode in (None, ir.ROUNDING_MODE.RTNE):
            dtype, bits = wrong[output_dtype]
            values = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32))
            out = values.to(dtype).view(bits).numpy()
            return out.view(np.uint16) if bits == torch.int16 else out
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float


@functools.cache
def _patch_interpreter_bf16_dot(tl) -> None:
    """Let triton<=3.6's CPU interpreter run ``tl.dot`` on bfloat16 operands.

    The interpreter keeps bfloat16 as its uint16 bit patterns and its ``create_dot`` multiplies
    those integers (a 16x16 product of N(0, 1) values comes out near 1e10). The operands are
    widened to the float32 values they stand for (bf16 is float32's upper half), which is what
    the tensor cores multiply; only where the interpreter's own dot is found wrong.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    one = interpreter.TensorHandle(np.full((16, 16), 0x3F80, dtype=np.uint16), tl.bfloat16)   # bf16 1.0
    zero = interpreter.TensorHandle(np.zeros((16, 16), dtype=np.float32), tl.float32)
    if original(None, one, one, zero, None, None).data[0, 0] == 16.0:
        return

    def widen(t):
        if t.dtype.scalar == tl.bfloat16:
            bits = t.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return t

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
