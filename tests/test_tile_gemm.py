"""The tile GEMM for decode steps of 16-256 rows (``kernels/tile_gemm.py``) against the torch
references, on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by conftest): the
same fusions as the one-row GEMV (an RMSNorm + residual folded into the product, an activation
or a gated activation after it, the K/V store of a q|k|v projection), over several row blocks
and a K loop of several tiles; LayerNorm prologues go to the references."""
import pytest
import torch

pytest.importorskip("triton")

from enc2dec.kernels import reference as ref  # noqa: E402
from enc2dec.kernels import skinny_gemm  # noqa: E402
from enc2dec.kernels.skinny_gemm import Prologue  # noqa: E402
from enc2dec.kernels.tile_gemm import tile_linear  # noqa: E402
from test_kernels import _FUSIONS, DEVICE, assert_close, check_fused, check_qkv_store  # noqa: E402

SMALL = (32, 32, 32, 4, 2)       # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: several blocks of each at test sizes


def small_tiles(x, w, b=None, **kwargs):
    return tile_linear(x, w, b, config=SMALL, **kwargs)


# A folded RMSNorm rounds h * g where the separate kernels round h * rstd and then its product by g;
# the interpreter rounds bfloat16 toward zero, so the two roundings drift apart there in the same
# direction over a whole row. Those cases are checked in float32 here and in bfloat16 on the GPU
# against float64 (test_kernels_gpu.py).
CASES = [(name, dtype) for name in _FUSIONS for dtype in (torch.float32, torch.bfloat16)
         if not (name.startswith("rms") and dtype == torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", CASES)
@pytest.mark.parametrize("rows,n,k", [(40, 48, 100), (7, 20, 64)])     # 40 rows: two row blocks, a ragged one
def test_tile_linear_fuses_the_norm_before_it_and_the_activation_after_it(name, dtype, rows, n, k):
    check_fused(name, rows, n, k, dtype, linear=small_tiles)


@pytest.mark.parametrize("rows,slots", [(3, [0, 9, -1]), (36, list(range(35, -1, -1)))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_qkv_projection_stores_k_and_v_in_the_cache(rows, slots, dtype):
    check_qkv_store(rows, slots, dtype, blocks=10, linear=small_tiles)


def test_a_t5_mlp_input_with_its_norm_and_gate_in_one_launch_at_64_rows(monkeypatch):
    # flan-t5's feed-forward at a C=64 decode step, narrowed: add + RMSNorm folded into the
    # gate|up product, gelu_tanh(gate) * up after it; the default launch config; the kernel
    # must run (not the reference fallback) and the residual stream must be written whole.
    from enc2dec.kernels import tile_gemm

    launches = []
    kernel = tile_gemm._tile_gemm_kernel
    monkeypatch.setattr(tile_gemm, "_tile_gemm_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launches.append(grid), kernel[grid])[1]})())
    g = torch.Generator().manual_seed(0)
    rows, k, n = 64, 96, 80
    x, res = (torch.randn(rows, k, generator=g).to(DEVICE) for _ in range(2))
    gain = 1 + 0.1 * torch.randn(k, generator=g).to(DEVICE)
    w = torch.randn(2 * n, k, generator=g).to(DEVICE) / k ** 0.5
    fused = Prologue(x, residual=res, norm_weight=gain, eps=1e-6)
    got = tile_linear(fused, w, act="gelu_tanh", gated=True)
    normed, new_res = ref.fused_add_rms_norm_ref(x, res, gain, 1e-6)
    want = skinny_gemm.activation_ref(ref.skinny_linear_ref(normed, w), "gelu_tanh", True)
    assert launches and got.shape == (rows, n)
    assert_close(got, want, torch.float32)
    assert torch.equal(fused.res_out, new_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_encoder_batch_with_bias_and_gelu_in_the_epilogue(dtype):
    # Whisper's encoder fc1 shape, narrowed: more rows than a decode step, so the default
    # launch takes the 128 x 128 compute tile (three row blocks, two column blocks here).
    from enc2dec.kernels import tile_gemm

    g = torch.Generator().manual_seed(1)
    rows, n, k = 300, 136, 72
    assert tile_gemm.launch_config(rows, n, k)[:2] == (128, 128)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    want = skinny_gemm.activation_ref(ref.skinny_linear_ref(x.float(), w.float(), b.float()).to(dtype), "gelu", False)
    assert_close(tile_linear(x, w, b, act="gelu"), want, dtype)
