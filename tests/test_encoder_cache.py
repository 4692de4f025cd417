"""The encoder cache on CPU with fake sizes: a request whose ``encoder_cache_key`` names the cross
blocks of a finished request decodes from them without being encoded, the blocks stay
untouched while cached, and they give way to requests that need room.

``PagedFakeModel`` writes an encoder input into its cross slots only when the step encodes it
(``reuses_cross_kv`` False) and derives every token from what it reads back, so a hit on blocks
that were freed, rewritten or never written changes the tokens.
"""
from __future__ import annotations

import pytest

from enc2dec.engine.core.encoder_cache import EncoderCache
from enc2dec.engine.core.block_manager import BlockPool
from enc2dec.engine.core.request import RequestStatus
from enc2dec.engine.core.scheduler import Scheduler
from test_scheduler import PagedFakeModel, limits, make_request

TPB = 4
ENC_LEN = 8             # two cross blocks per request


class EncodeCountingModel(PagedFakeModel):
    def __init__(self, *a):
        super().__init__(*a)
        self.num_encoded = 0

    def execute(self, so):
        for enc in so.encodes:
            if enc.reuses_cross_kv:                    # the runner writes nothing for it
                self.seq_index.update(zip(enc.seq_ids, enc.seq_indices))
        fresh = [e for e in so.encodes if not e.reuses_cross_kv]
        self.num_encoded += len(fresh)
        so_fresh = type(so)(encodes=fresh, seqs=so.seqs)
        return super().execute(so_fresh)


def drain(sched, model, max_steps=500):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        so = sched.schedule()
        sched.update(so, model.execute(so))
    raise AssertionError("the scheduler did not drain")


def request(rid, key=None, input_of=None, max_tokens=5):
    req = make_request(input_of or rid, ENC_LEN, max_tokens, ignore_eos=True, encoder_cache_key=key)
    req.request_id = rid
    return req


def tokens(req):
    return req.seqs[0].output_token_ids


def test_a_request_with_a_finished_requests_key_is_not_encoded_and_decodes_the_same_tokens():
    sched = Scheduler(limits(tokens_per_block=TPB), 100, 4)          # cross pool: two requests
    model = EncodeCountingModel(100, 4, TPB)
    first = request("first", key="clip")
    sched.add_request(first)
    drain(sched, model)
    # Other inputs in between: had the cache not kept the first's blocks, the second would take them.
    for rid in ("other", "another"):
        other = request(rid)
        sched.add_request(other)
        drain(sched, model)
    retry = request("retry", key="clip", input_of="first")
    sched.add_request(retry)
    so = sched.schedule()
    assert [e.reuses_cross_kv for e in so.encodes] == [True] and so.num_encoder_tokens == 0
    sched.update(so, model.execute(so))
    drain(sched, model)
    assert model.num_encoded == 3 and sched.encoder_cache.num_hits == 1
    assert tokens(retry) == tokens(first) and tokens(other) != tokens(first)
    fresh = request("fresh", input_of="first")      # the same input encoded anew: the same tokens
    sched.add_request(fresh)
    drain(sched, model)
    assert tokens(fresh) == tokens(first)


def test_cached_blocks_give_way_to_a_request_that_needs_room():
    sched = Scheduler(limits(tokens_per_block=TPB), 100, 4)
    model = EncodeCountingModel(100, 4, TPB)
    for rid in ("a", "b"):
        sched.add_request(request(rid, key=rid))
        drain(sched, model)
    assert len(sched.encoder_cache) == 2 and sched.cross_pool.num_free_blocks == 0
    sched.add_request(request("c"))
    so = sched.schedule()
    assert [e.request_id for e in so.encodes] == ["c"], "the cache must not block admission"
    assert "a" not in sched.encoder_cache and "b" in sched.encoder_cache     # the oldest went
    sched.update(so, model.execute(so))
    drain(sched, model)
    again = request("again", key="a", input_of="a")
    sched.add_request(again)
    drain(sched, model)
    assert model.num_encoded == 4, "an evicted key is encoded again"


def test_an_entry_a_running_request_shares_is_not_counted_as_room():
    sched = Scheduler(limits(tokens_per_block=TPB), 100, 4)
    model = EncodeCountingModel(100, 4, TPB)
    first = request("a", key="k")
    sched.add_request(first)
    drain(sched, model)
    hit = request("hit", key="k", input_of="a", max_tokens=20)
    blocker = request("blocker", max_tokens=20)
    sched.add_request(hit)
    sched.add_request(blocker)
    so = sched.schedule()                       # hit shares k's blocks; blocker takes the other two
    sched.update(so, model.execute(so))
    late = request("late")
    sched.add_request(late)
    so = sched.schedule()
    # k's blocks are held by hit as well: evicting k would free nothing, so late waits.
    assert not so.encodes and "k" in sched.encoder_cache
    sched.update(so, model.execute(so))
    drain(sched, model)
    assert late.status is RequestStatus.FINISHED_LENGTH
    assert tokens(hit)[:5] == tokens(first)


def test_aborted_requests_are_not_cached_and_the_bound_holds():
    sched = Scheduler(limits(tokens_per_block=TPB), 100, 40, max_cached_encodes=2)
    model = EncodeCountingModel(100, 40, TPB)
    aborted = request("aborted", key="x")
    sched.add_request(aborted)
    so = sched.schedule()
    sched.update(so, model.execute(so))
    sched.abort_request("aborted")
    assert "x" not in sched.encoder_cache
    for i in range(3):
        sched.add_request(request(f"r{i}", key=f"k{i}"))
    drain(sched, model)
    assert len(sched.encoder_cache) == 2 and "k0" not in sched.encoder_cache
    assert sched.cross_pool.num_used_blocks == 2 * 2      # two entries of two blocks, nothing leaked


def test_encoder_cache_keeps_one_entry_per_key():
    pool = BlockPool(8)
    cache = EncoderCache(pool, max_entries=4)
    cache.keep("k", pool.allocate(2))
    cache.keep("k", pool.allocate(2))              # a second finished request of the same input
    assert len(cache) == 1 and pool.num_used_blocks == 2
    shared = cache.share("k")
    assert cache.num_evictable_blocks() == 0
    pool.free(shared)
    assert cache.num_evictable_blocks() == 2
    cache.make_room(8)
    assert len(cache) == 0 and pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="max_entries"):
        EncoderCache(pool, max_entries=-1)
