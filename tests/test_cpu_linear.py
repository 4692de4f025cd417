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
