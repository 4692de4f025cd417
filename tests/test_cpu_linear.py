"""MKL packed CPU projections (engine/models/cpu_linear.py): same products as F.linear to
float32 rounding at every row count, packed or not, and the model's logits unchanged."""
import pytest
import torch
import torch.nn.functional as F

from enc2dec.engine.models import cpu_linear
from enc2dec.engine.models.cpu_linear import PACK_AFTER_CALLS, packed_linear

pytestmark = pytest.mark.skipif(not cpu_linear.packed_cpu_linear_available(torch.device("cpu"), torch.float32),
                                reason="this torch has no MKL packed sgemm")


def _pack_key(rows: int) -> int | None:
    """The pack a product of ``rows`` rows goes through: its own count for 2-8 rows, the next
    bucket up to the last one, none past it or for one row."""
    if cpu_linear.MIN_ROWS <= rows <= cpu_linear.MAX_ROWS:
        return rows
    return next((b for b in cpu_linear.BUCKET_ROWS if cpu_linear.MAX_ROWS < rows <= b), None)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 24, 32, 40, 48, 64, 65])
def test_matches_f_linear_before_and_after_packing(rows):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(67, 45, generator=g), torch.randn(67, generator=g)
    packs = {}
    for _ in range(PACK_AFTER_CALLS + 2):
        x = torch.randn(rows, 45, generator=g)
        torch.testing.assert_close(packed_linear(packs, x, weight, bias), F.linear(x, weight, bias))
    assert set(packs) - {"seen"} == ({_pack_key(rows)} - {None})


def test_a_bucket_pads_short_batches_without_changing_any_row():
    """Encoder batches of 9-64 rows share a bucket's pack: every count gives F.linear's product
    to rounding, keeps its leading dims, and a row's output does not depend on how many rows
    were padded beside it (a prompt's encoding is the same whatever its batch)."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    probe = torch.randn(1, 24, generator=g)
    packs, alone = {}, {}
    for rows in list(range(9, 40)) * cpu_linear.BUCKET_PACK_AFTER_CALLS:
        x = torch.cat([probe, torch.randn(rows - 1, 24, generator=g)])
        got = packed_linear(packs, x.view(1, rows, 24), weight, bias)
        assert got.shape == (1, rows, 40)
        torch.testing.assert_close(got[0], F.linear(x, weight, bias))
        m = _pack_key(rows)
        if m in packs:
            assert torch.equal(got[0, 0], alone.setdefault(m, got[0, 0]))
    first = set(cpu_linear.BUCKET_ROWS[:cpu_linear.MAX_BUCKET_PACKS])      # the first buckets reached
    assert set(packs) - {"seen"} == first and set(alone) == first


def test_buckets_leave_a_pack_for_the_decode_row_counts():
    """A layer that met two buckets first (an encoder's prompt lengths, a CPU batch's sizes) still
    packs a 2-8-row decode count: buckets hold at most MAX_BUCKET_PACKS of its MAX_PACKS."""
    weight, packs = torch.randn(16, 8), {}
    for rows in (12, 20, 4):
        for _ in range(PACK_AFTER_CALLS):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(packed_linear(packs, x, weight, None), F.linear(x, weight))
    assert set(packs) - {"seen"} == {16, 4}


def test_packs_at_most_max_packs_row_counts():
    weight, packs = torch.randn(16, 8), {}
    for rows in range(2, 2 + cpu_linear.MAX_PACKS + 2):
        for _ in range(PACK_AFTER_CALLS):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(packed_linear(packs, x, weight, None), F.linear(x, weight))
    assert len([k for k in packs if k != "seen"]) == cpu_linear.MAX_PACKS


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("act,bias", [("gelu", True), ("relu", False), ("gelu_new", True)])
@pytest.mark.parametrize("rows", [1, 5, cpu_linear.FUSED_ACT_MIN_ROWS, 301, 2 * cpu_linear.MLP_CHUNK_ROWS + 7])
def test_dense_mlp_with_fused_activation_matches_the_plain_one(act, bias, rows):
    from enc2dec.engine.models.layers import DenseMLP

    torch.manual_seed(rows)
    mlp = DenseMLP(48, 200, act, bias=bias).requires_grad_(False)     # as the loader leaves it
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(rows, 48)            # past MLP_CHUNK_ROWS: three chunks, the last a short one
    with torch.no_grad():
        expected = mlp(x)
        assert cpu_linear.use_packed_cpu_linear(mlp) == 2
        assert isinstance(mlp, cpu_linear.FusedActCpuDenseMLP)
        got = mlp(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a module that trains keeps the plain path (the fused op has no autograd)
    mlp.requires_grad_(True)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_lm_head_pads_a_step_up_to_a_packed_row_count_without_changing_any_row():
    """The head is packed for a few row counts and a step of fewer rows is padded: every count
    from 1 to 17 gives F.linear's logits to rounding, a row's logits do not depend on the rows
    beside it (what a seeded request's reproducibility across batches needs), and at most
    HEAD_MAX_PACKS packs are kept."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 24, generator=g)
    head = cpu_linear.PackedHead()
    probe = torch.randn(1, 24, generator=g)
    alone = {}
    for rows in list(range(1, 18)) * cpu_linear.HEAD_PACK_AFTER_CALLS:
        others = torch.randn(rows - 1, 24, generator=g)
        x = torch.cat([probe, others])
        got = head(x, weight)
        assert got.shape == (rows, 300)
        torch.testing.assert_close(got, F.linear(x, weight))
        m = next((b for b in cpu_linear.HEAD_PACK_ROWS if rows <= b), None)
        if m in head.packs:      # through a pack: the probe row is the same whatever sits beside it
            assert torch.equal(got[0], alone.setdefault(m, got[0]))
    assert len(head.packs) == cpu_linear.HEAD_MAX_PACKS and set(head.packs) <= set(cpu_linear.HEAD_PACK_ROWS)
    assert len(alone) == cpu_linear.HEAD_MAX_PACKS       # rows went through both packs


def test_bucket_packs_stop_at_the_models_budget():
    """Bucket packs are a one-time copy of each weight: a model packs at most its budget's bytes
    of them (the rest keep F.linear, products unchanged), while 2-8-row packs are not counted."""
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(32, 16, generator=g) for _ in range(3)]
    one = weights[0].numel() * weights[0].element_size()
    budget = cpu_linear.PackBudget(2 * one)
    layers = [{} for _ in weights]
    for _ in range(cpu_linear.PACK_AFTER_CALLS):
        for packs, w in zip(layers, weights):
            for rows in (20, 5):
                x = torch.randn(rows, 16, generator=g)
                torch.testing.assert_close(packed_linear(packs, x, w, None, budget), F.linear(x, w))
    assert [set(p) - {"seen"} for p in layers] == [{24, 5}, {24, 5}, {5}]
    assert budget.left == 0


def test_use_packed_cpu_linear_gives_every_layer_one_shared_budget():
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).requires_grad_(False)
    assert cpu_linear.use_packed_cpu_linear(model) == 2
    budgets = {id(m._mkl_budget) for m in model}
    assert len(budgets) == 1 and model[0]._mkl_budget.left == cpu_linear.BUCKET_PACK_BYTES
    x = torch.randn(12, 8)
    for _ in range(cpu_linear.BUCKET_PACK_AFTER_CALLS):
        y = model(x)
    torch.testing.assert_close(y, F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias))
    assert model[0]._mkl_budget.left == cpu_linear.BUCKET_PACK_BYTES - 2 * 8 * 8 * 4
