"""Cross-attention blocks come as one run of consecutive ids (the torch backend then reads a
request's encoder K/V as a view of the pool rather than gathering a copy every step)."""
from enc2dec.engine.core.block_manager import BlockPool
from enc2dec.engine.core.scheduler import Scheduler

from test_scheduler import PagedFakeModel, make_request, limits, run_all


def is_run(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))


def test_prefer_run_skips_a_straddling_front():
    pool = BlockPool(10)
    pool.allocate(10)
    pool.free([5])
    pool.free([0, 1, 2])
    pool.free([7])                                                      # free list: 7, 0, 1, 2, 5
    assert pool.allocate(3, prefer_run=True) == [0, 1, 2]
    assert pool.num_free_blocks == 2 and pool.ref_count(7) == 0
    pool.free([3])
    pool.free([4])                                                      # 4, 3, 5, 7
    assert pool.allocate(3) == [4, 3, 5], "plain allocate takes the most recently freed first"
    assert not pool.can_allocate(2)


def test_prefer_run_falls_back_to_the_free_lists_order_when_no_run_exists():
    pool = BlockPool(6)
    held = [pool.allocate(1) for _ in range(6)]
    for ids in held[::2] + held[1::2]:                                  # free list 5, 3, 1, 4, 2, 0
        pool.free(ids)
    got = pool.allocate(3, prefer_run=True)
    assert len(set(got)) == 3 and all(pool.ref_count(i) == 1 for i in got) and pool.num_free_blocks == 3


def test_whisper_like_requests_get_consecutive_cross_blocks():
    # 5 blocks per request in a pool of 23: FIFO reuse alone straddled two freed runs from
    # the fifth admission on.
    tpb, enc_len = 4, 20
    sched = Scheduler(limits(tokens_per_block=tpb, max_batch_size=3), num_self_blocks=400, num_cross_blocks=23)
    seen = []
    original = sched.cross_pool.allocate

    def recording(n, **kw):
        ids = original(n, **kw)
        seen.append(ids)
        return ids

    sched.cross_pool.allocate = recording
    arrivals = {step: [make_request(f"r{step}-{i}", enc_len, max_output_tokens=3 + (step + i) % 4)
                       for i in range(2)] for step in range(0, 40, 3)}
    run_all(sched, PagedFakeModel(400, 23, tpb), arrivals)
    assert len(seen) == 28
    assert all(is_run(ids) for ids in seen), [ids for ids in seen if not is_run(ids)]
    assert sched.cross_pool.num_free_blocks == 23
