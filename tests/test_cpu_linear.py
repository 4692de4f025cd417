"""MKL packed CPU projections (engine/models/cpu_linear.py): same products as F.linear to
float32 rounding at every row count, packed or not, and the model's logits unchanged."""
import pytest
import torch
import torch.nn.functional as F

from enc2dec.engine.models import cpu_linear
from enc2dec.engine.models.cpu_linear import PACK_AFTER_CALLS, packed_linear

pytestmark = pytest.mark.skipif(not cpu_linear.packed_cpu_linear_available(torch.device("cpu"), torch.float32),
                                reason="this torch has no MKL packed sgemm")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9])
def test_matches_f_linear_before_and_after_packing(rows):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(67, 45, generator=g), torch.randn(67, generator=g)
    packs = {}
    for _ in range(PACK_AFTER_CALLS + 2):
        x = torch.randn(rows, 45, generator=g)
        torch.testing.assert_close(packed_linear(packs, x, weight, bias), F.linear(x, weight, bias))
    assert (rows in packs) == (cpu_linear.MIN_ROWS <= rows <= cpu_linear.MAX_ROWS)


def test_packs_at_most_max_packs_row_counts():
    weight, packs = torch.randn(16, 8), {}
    for rows in range(2, 2 + cpu_linear.MAX_PACKS + 2):
        for _ in range(PACK_AFTER_CALLS):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(packed_linear(packs, x, weight, None), F.linear(x, weight))
    assert len([k for k in packs if k != "seen"]) == cpu_linear.MAX_PACKS


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("act,bias", [("gelu", True), ("relu", False), ("gelu_new", True)])
@pytest.mark.parametrize("rows", [1, 5, cpu_linear.FUSED_ACT_MIN_ROWS, 301])
def test_dense_mlp_with_fused_activation_matches_the_plain_one(act, bias, rows):
    from enc2dec.engine.models.layers import DenseMLP

    torch.manual_seed(rows)
    mlp = DenseMLP(48, 200, act, bias=bias).requires_grad_(False)     # as the loader leaves it
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        expected = mlp(x)
        assert cpu_linear.use_packed_cpu_linear(mlp) == 2
        assert isinstance(mlp, cpu_linear.FusedActCpuDenseMLP)
        got = mlp(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a module that trains keeps the plain path (the fused op has no autograd)
    mlp.requires_grad_(True)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
