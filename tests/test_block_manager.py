"""Block pool accounting and KV pool sizing: pure Python, fake sizes."""
import os
import random

import pytest

from enc2dec.engine.core.block_manager import BlockAllocationError, BlockPool, blocks_needed
from enc2dec.engine.core.kv_sizing import KvPoolPlan, kv_bytes_per_token, plan_kv_pools

GIB = 1 << 30


# ------------------------------------------------------------------------------ BlockPool

def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 32) for n in (0, 1, 32, 33, 64, 1500)] == [0, 1, 1, 2, 2, 47]
    assert blocks_needed(7, 1) == 7


def test_allocate_and_free_counts():
    pool = BlockPool(8)
    assert (pool.num_total_blocks, pool.num_free_blocks, pool.num_used_blocks) == (8, 8, 0)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free_blocks == 0
    assert all(pool.ref_count(i) == 1 for i in a + b)
    assert pool.can_allocate(0) and not pool.can_allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 5
    assert all(pool.ref_count(i) == 0 for i in a)
    pool.free(b)
    assert pool.num_free_blocks == 8


def test_the_peak_remembers_the_most_blocks_held_until_reset():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    pool.free(a)
    c = pool.allocate(1)
    assert pool.num_used_blocks == 3 and pool.peak_used_blocks == 5
    pool.reset_peak()
    assert pool.peak_used_blocks == 3
    pool.free(b + c)
    assert pool.peak_used_blocks == 3          # a reset peak starts from what was held, not from 0
    pool.reset_peak()
    pool.allocate(2)
    assert pool.peak_used_blocks == 2


def test_allocate_beyond_free_raises():
    pool = BlockPool(4)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(BlockAllocationError, match="cannot allocate 2 blocks: 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1, "a failed allocate must not take blocks"
    assert issubclass(BlockAllocationError, RuntimeError)


def test_the_most_recently_freed_blocks_are_handed_out_first():
    """A lazily mapped CPU pool stays at the pages of its high-water mark: requests that come
    and go reuse the same blocks, in the order a request freed them (a run stays a run)."""
    pool = BlockPool(100)
    handed = set()
    for i in range(50):
        held = [pool.allocate(2 + i % 3) for _ in range(2)]             # two requests at a time
        handed.update(b for ids in held for b in ids)
        for ids in held:
            pool.free(ids)
    assert handed == set(range(8))                                      # FIFO would walk all 100
    ids = pool.allocate(4)
    pool.free(ids)
    assert pool.allocate(4) == ids


def test_double_free_is_an_assertion():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(ids[:1])
    assert pool.num_free_blocks == 4


def test_fork_shares_until_last_owner_frees():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    shared = pool.fork(ids)
    assert shared == ids and [pool.ref_count(i) for i in ids] == [2, 2]
    pool.free(ids)
    assert pool.num_free_blocks == 2, "blocks still held by the fork must stay used"
    pool.free(shared)
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError):
        pool.fork(ids)   # forking a free block is a bug


def test_negative_size_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)


def test_random_churn_never_leaks():
    rng = random.Random(0)
    pool = BlockPool(64)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not pool.can_allocate(1)):
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.2:
                held.append(pool.fork(blocks))
            pool.free(blocks)
        else:
            n = rng.randint(0, 6)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
        refs = {}
        for blocks in held:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        assert pool.num_used_blocks == len(refs)
        assert all(pool.ref_count(b) == r for b, r in refs.items())
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == 64


# ------------------------------------------------------------------------------ kv sizing

def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    # Whisper-large-v3-like decoder: 32 layers, 20 heads of 64, bf16.
    assert kv_bytes_per_token(32, 20, 64, 2) == 2 * 32 * 20 * 64 * 2
    with pytest.raises(ValueError, match="num_heads"):
        kv_bytes_per_token(32, 0, 64, 2)


def test_plan_splits_budget_by_cross_fraction():
    per_token = kv_bytes_per_token(24, 16, 64, 2)     # 98,304 bytes
    plan = plan_kv_pools(4 * GIB, 0.25, 32, per_token)
    bytes_per_block = 32 * per_token
    assert plan.bytes_per_block == bytes_per_block
    assert plan.num_cross_blocks == GIB // bytes_per_block
    assert plan.num_self_blocks == 3 * GIB // bytes_per_block
    assert plan.cross_bytes == plan.num_cross_blocks * bytes_per_block <= GIB
    assert plan.self_bytes == plan.num_self_blocks * bytes_per_block <= 3 * GIB
    assert plan.tokens_per_block == 32
    half = plan_kv_pools(4 * GIB, 0.5, 32, per_token)
    assert half.num_self_blocks == half.num_cross_blocks == 2 * GIB // bytes_per_block


def test_plan_describe_and_capacity():
    plan = KvPoolPlan(num_self_blocks=1234, num_cross_blocks=567, tokens_per_block=32,
                      bytes_per_block=2 * 1024 * 1024, self_bytes=1234 * 2 << 20,
                      cross_bytes=567 * 2 << 20)
    assert plan.max_requests_by_cross(1500) == 567 // 47 == 12
    assert plan.max_seqs_by_self(448) == 1234 // 14
    line = plan.describe(1500, 448)
    assert "self pool 1234 blocks x 32 tokens (2.4 GiB)" in line
    assert "cross pool 567 blocks (1.1 GiB)" in line
    assert "holds 12 requests of 1500 encoder positions" in line
    assert "88 sequences of 448 decoder positions" in line


@pytest.mark.parametrize("fraction, pool", [(0.001, "cross-attention"), (0.999, "self-attention")])
def test_budget_too_small_names_the_options(fraction, pool):
    per_token = kv_bytes_per_token(2, 4, 64, 2)        # 2,048 bytes; a 32-token block is 64 KiB
    with pytest.raises(ValueError) as e:
        plan_kv_pools(1 << 20, fraction, 32, per_token)
    message = str(e.value)
    assert pool in message and "cross_kv_cache_fraction" in message
    assert "free_gpu_memory_fraction" in message


def test_no_budget_at_all_raises():
    with pytest.raises(ValueError, match="free_gpu_memory_fraction"):
        plan_kv_pools(0, 0.5, 32, 1024)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_must_be_inside_zero_one(fraction):
    with pytest.raises(ValueError, match="cross_kv_cache_fraction"):
        plan_kv_pools(GIB, fraction, 32, 1024)


def test_an_unset_cpu_budget_is_a_quarter_of_the_available_memory_up_to_4_gib():
    from enc2dec.engine.core.kv_sizing import auto_cpu_kv_budget

    assert auto_cpu_kv_budget(available=8 * GIB) == 2 * GIB
    assert auto_cpu_kv_budget(available=1 * GIB) == GIB // 4           # a small container stays small
    assert auto_cpu_kv_budget(available=200 * GIB) == 4 * GIB
    assert 0 < auto_cpu_kv_budget() <= 4 * GIB                         # this machine's, read from /proc


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_cpu_pools_take_memory_only_for_the_blocks_written():
    import torch

    from enc2dec.engine.models.attention import KVCache

    before = _rss_bytes()
    # 2 layers x 2 pools x K and V x 2,048 blocks x 32 x 8 x 64 float32 = 1 GiB of pools
    kv = KVCache.allocate(2, 8, 64, 32, 2048, 2048, torch.float32, "cpu")
    assert _rss_bytes() - before < 64 << 20
    layer = kv.cross_kv[1]
    assert layer.k.shape == (2048, 32, 8, 64) and layer.k.dtype == torch.float32
    layer.k[5].fill_(2.0)
    assert float(layer.k[5].sum()) == 2.0 * 32 * 8 * 64
    assert float(layer.k[4].abs().sum()) == 0.0 and float(layer.v[2047].abs().sum()) == 0.0
    assert _rss_bytes() - before < 64 << 20
    fp8 = KVCache.allocate(1, 8, 64, 32, 64, 64, torch.bfloat16, "cpu", fp8=True)
    assert fp8.self_kv[0].k.dtype == torch.float8_e4m3fn and float(fp8.self_kv[0].k.float().abs().sum()) == 0.0


def test_pool_layouts():
    """Head-major pools keep the usual shape with heads outermost in memory; the cross pools'
    layout can be chosen alone (the triton backend's tuning.cross_kv_head_major), FP8 values and
    their scales included."""
    import torch

    from enc2dec.engine.models.attention import KVCache

    def heads_outermost(t):
        return t.stride(2) == t.shape[0] * t.shape[1] * t.shape[3]

    cpu = KVCache.allocate(1, 4, 8, 16, 10, 12, torch.float32, "cpu", head_major=True)
    assert all(heads_outermost(t) for t in (cpu.self_kv[0].k, cpu.cross_kv[0].v))
    for fp8 in (False, True):
        kv = KVCache.allocate(1, 4, 8, 16, 10, 12, torch.bfloat16, "cpu", fp8=fp8, cross_head_major=True)
        assert kv.self_kv[0].k.is_contiguous() and kv.self_kv[0].k.shape == (10, 16, 4, 8)
        cross = kv.cross_kv[0]
        assert cross.k.shape == cross.v.shape == (12, 16, 4, 8) and heads_outermost(cross.k) and heads_outermost(cross.v)
        assert fp8 == (cross.k.dtype == torch.float8_e4m3fn)
        if fp8:         # the scales follow their values
            assert cross.k_scale.shape == (12, 16, 4) and cross.k_scale.stride(2) == 12 * 16
            assert kv.self_kv[0].k_scale.is_contiguous()
    # FP8 pools on the torch backend (head_major=True) stay token-major, as that backend reads them
    fp8_cpu = KVCache.allocate(1, 4, 8, 16, 10, 12, torch.bfloat16, "cpu", fp8=True, head_major=True)
    assert fp8_cpu.self_kv[0].k.is_contiguous() and fp8_cpu.cross_kv[0].k.is_contiguous()
