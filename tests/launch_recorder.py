"""Record a kernel module's Triton launches instead of running them: the arguments and launch
options each op gives its kernels, on CPU tensors. Used by ``kernel_aot.py`` (which compiles
each launch for sm_90) and by tests that check what a launch would be specialised on."""
from __future__ import annotations

import contextlib

from enc2dec.kernels import lazy_jit


class _Recorder:
    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, self.kernel, args, kwargs))
        return launch


@contextlib.contextmanager
def recorded(module):
    """The module's ``lazy_jit`` kernels record their launches into the yielded list, and its
    ops take the Triton path on CPU tensors."""
    launches = []
    saved = dict(vars(module))
    for name, value in saved.items():
        if isinstance(value, lazy_jit):
            setattr(module, name, _Recorder(name, value, launches))
    module.can_use_triton = lambda *tensors: True
    try:
        yield launches
    finally:
        for name in [n for n in vars(module) if n not in saved]:
            delattr(module, name)
        for name, value in saved.items():
            setattr(module, name, value)
