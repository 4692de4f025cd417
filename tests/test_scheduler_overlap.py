"""The overlap contract of the scheduler on CPU: step N+1 is scheduled from N's placeholders
while N "runs", and a request that needs its tokens on the host (``needs_host_tokens``) pauses
alone while its step is in flight. Driven the way EngineCore drives it (schedule, launch,
advance, resolve the previous step); the fake runner takes a placeholder's token from the
step just before, as the GPU runner does, so a placeholder that outlived its step changes
the tokens."""
import dataclasses
import random

import pytest

from enc2dec.engine.core.batch import SchedulerOutput
from enc2dec.engine.core.request import PLACEHOLDER_TOKEN_ID, RequestStatus
from enc2dec.engine.core.scheduler import Scheduler
from test_scheduler import PagedFakeModel, all_requests, check_blocks, check_limits, limits, make_request, run_all


class OverlapFakeModel(PagedFakeModel):
    def __init__(self, *args):
        super().__init__(*args)
        self.prev: dict[int, int] = {}   # seq_id -> token sampled by the previous step

    def execute(self, so: SchedulerOutput):
        fed = []
        for s in so.seqs:
            if s.output_token_ids is not None:
                assert PLACEHOLDER_TOKEN_ID not in s.output_token_ids, f"seq {s.seq_id} got a placeholder"
            ids = s.input_token_ids
            assert PLACEHOLDER_TOKEN_ID not in ids[:-1]
            if ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert s.seq_id in self.prev, f"seq {s.seq_id}: placeholder of a step that is not the last one"
                ids = ids[:-1] + [self.prev[s.seq_id]]
            fed.append(dataclasses.replace(s, input_token_ids=ids))
        out = super().execute(dataclasses.replace(so, seqs=fed))
        self.prev = {s.seq_id: t for s, t in zip(fed, out.token_ids)}
        return out


def run_overlap(sched: Scheduler, model, arrivals, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """EngineCore.step with overlap: launch N+1, then resolve N. Returns the launched steps."""
    launched, inflight, admitted_at = [], None, {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step > max(arrivals) and not sched.has_unfinished_requests() and inflight is None:
            return launched
        so = sched.schedule()
        check_blocks(sched)
        check_limits(sched, so, exclude_ended=True)
        for rid in so.preempted_request_ids:   # growth room was kept at admission, paused or not
            assert admitted_at.get(rid) != len(launched) - 1, f"{rid} preempted right after admission"
        if so.is_empty:
            if inflight is not None:
                sched.resolve(*inflight)
                inflight = None
            continue
        admitted_at.update((e.request_id, len(launched)) for e in so.encodes)
        ro = model.execute(so)
        sched.advance(so)
        if inflight is not None:
            sched.resolve(*inflight)
        inflight = (so, ro)
        launched.append(so)
    raise AssertionError("the scheduler did not drain")


def workload(seed: int, num_requests: int = 40):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(num_requests):
        req = make_request(f"r{i}", rng.randint(1, 30), rng.randint(2, 30), n=rng.randint(1, 3),
                           min_tokens=rng.choice([0, 0, 3]), ignore_eos=rng.random() < 0.3,
                           needs_host_tokens=rng.random() < 0.3)
        arrivals.setdefault(rng.randint(0, 40), []).append(req)
    return arrivals


def results(arrivals):
    return {(r.request_id, s.index): (s.token_ids, s.status, s.cumulative_logprob, len(s.logprobs or ()))
            for r in all_requests(arrivals) for s in r.seqs}


@pytest.mark.parametrize("seed, num_self_blocks", [(1, 10_000), (2, 10_000), (3, 30), (4, 30)])
def test_overlap_with_paused_requests_gives_the_tokens_of_waited_steps(seed, num_self_blocks):
    def sched():
        return Scheduler(limits(max_batch_size=10, max_num_tokens=400, tokens_per_block=4), num_self_blocks, 1000)

    reference = workload(seed)
    run_all(sched(), PagedFakeModel(num_self_blocks, 1000, 4), reference)
    arrivals = workload(seed)
    s = sched()
    run_overlap(s, OverlapFakeModel(num_self_blocks, 1000, 4), arrivals)
    assert results(arrivals) == results(reference)
    assert any(r.needs_host_tokens for r in all_requests(arrivals))
    assert all(r.is_finished and r.status is not RequestStatus.FINISHED_ABORTED for r in all_requests(arrivals))
    assert s.self_pool.num_used_blocks == s.cross_pool.num_used_blocks == 0
    if num_self_blocks == 30:
        assert s.num_preemptions > 0, "the pool was meant to be tight enough to preempt"


def test_only_the_request_that_needs_host_tokens_pauses():
    host = make_request("host", 4, 12, ignore_eos=True, needs_host_tokens=True)
    plain = [make_request(f"p{i}", 4, 12, ignore_eos=True) for i in range(3)]
    sched = Scheduler(limits(tokens_per_block=4), 100, 100)
    launched = run_overlap(sched, OverlapFakeModel(100, 100, 4), {0: [host, *plain]})
    steps_of = {r.request_id: [i for i, so in enumerate(launched) if any(s.request_id == r.request_id
                                                                         for s in so.seqs)]
                for r in [host, *plain]}
    for r in plain:   # one token per step, every step, while the paused request is live
        assert steps_of[r.request_id] == list(range(12)), r.request_id
    # Every other step while the others run (its own tokens first), then every step alone.
    assert steps_of["host"] == [0, 2, 4, 6, 8, 10, 12, 13, 14, 15, 16, 17]
    assert all(s.output_token_ids is not None for so in launched for s in so.seqs if s.request_id == "host")
    assert host.seqs[0].num_output_tokens == 12


def test_preempting_a_paused_request_drops_its_step_in_flight():
    sched = Scheduler(limits(tokens_per_block=4), 100, 100)
    model = OverlapFakeModel(100, 100, 4)
    host = make_request("host", 4, 8, ignore_eos=True, needs_host_tokens=True)
    sched.add_request(host)
    so = sched.schedule()
    ro = model.execute(so)
    sched.advance(so)
    assert host.has_step_in_flight and sched.schedule().is_empty   # paused: nothing else to run
    sched._preempt(host)                                             # as a pool shortage would
    sched.resolve(so, ro)
    seq = host.seqs[0]
    assert seq.token_ids == [0] and seq.num_computed_tokens == 0 and not host.has_step_in_flight
    so = sched.schedule()                                            # readmitted, recomputed from scratch
    assert [e.request_id for e in so.encodes] == ["host"] and so.seqs[0].input_token_ids == [0]
