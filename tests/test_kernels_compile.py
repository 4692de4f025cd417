"""The GPU kernels compile for a Hopper GPU (sm_90) with the launch configurations the ops
choose at serving shapes, and fit its shared memory: checked on the CPU with Triton's own
compiler (``tests/kernel_aot.py``), since the interpreter that the other kernel tests use never
compiles them. Catches a kernel change that only a GPU would otherwise reject."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def test_every_engine_kernel_compiles_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_aot.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = {line.split(": ")[-1].split(" (")[0] for line in lines if line.startswith("ok ")}
    assert {"_skinny_gemm_kernel", "_paged_attention_kernel", "_merge_splits_kernel",
            "_store_kv_kernel", "_add_norm_kernel", "_gelu_kernel", "_gumbel_race_kernel", "_filtered_race_kernel",
            "_split_max_kernel", "_split_floor_kernel", "_split_round_kernel", "_split_finish_kernel"} <= compiled, \
        proc.stdout
