"""Scheduler policy on CPU with fake sizes and hand-built runner outputs.

``PagedFakeModel`` plays the model runner: it keeps a paged "KV cache" of plain lists,
writes each fed token into the slot its block table names, writes the encoder input
into the cross slots at encode time, and derives the next token from what it reads back
through the block tables. A wrong block table, a block shared by two live sequences, a
lost or duplicated token, or a stale ``num_computed_tokens`` all change the tokens.
"""
import random
import subprocess
import sys

import pytest

from enc2dec.engine.core.batch import ModelRunnerOutput, SchedulerOutput
from enc2dec.engine.core.request import Request, RequestStatus, Sequence
from enc2dec.engine.core.scheduler import Scheduler, SchedulerLimits

EOS = 42
BIG = 100_000


def next_token(context: list[int], encoder: list[int], seq_index: int) -> int:
    return (sum(context) * 31 + len(context) + sum(encoder) * 7 + seq_index * 11) % 50 + 10


class PagedFakeModel:
    def __init__(self, num_self_blocks: int, num_cross_blocks: int, tokens_per_block: int):
        self.tpb = tokens_per_block
        self.self_kv = [None] * (num_self_blocks * tokens_per_block)
        self.cross_kv = [None] * (num_cross_blocks * tokens_per_block)
        self.seq_index: dict[int, int] = {}

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.tpb] * self.tpb + pos % self.tpb

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for enc in so.encodes:
            for pos, tok in enumerate(enc.encoder_input):
                self.cross_kv[self._slot(enc.cross_block_ids, pos)] = tok
            self.seq_index.update(zip(enc.seq_ids, enc.seq_indices))
        tokens = []
        for s in so.seqs:
            for i, tok in enumerate(s.input_token_ids):
                self.self_kv[self._slot(s.block_ids, s.start_pos + i)] = tok
            context = [self.self_kv[self._slot(s.block_ids, p)] for p in range(s.seq_len)]
            encoder = [self.cross_kv[self._slot(s.cross_block_ids, p)] for p in range(s.encoder_len)]
            tok = next_token(context, encoder, self.seq_index[s.seq_id])
            tokens.append(tok)
        return ModelRunnerOutput(tokens, logprobs=[-0.25] * len(tokens), top_logprobs=[{t: -0.25} for t in tokens])


class ScriptedModel:
    """Returns the scripted tokens of each sequence index in order."""

    def __init__(self, script: list[int] | dict[int, list[int]]):
        self.script = script if isinstance(script, dict) else {0: script}
        self.seq_index: dict[int, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for enc in so.encodes:
            self.seq_index.update(zip(enc.seq_ids, enc.seq_indices))
        return ModelRunnerOutput([self.script[self.seq_index[s.seq_id]][s.num_output_tokens] for s in so.seqs])


def make_request(rid: str, encoder_len: int, max_output_tokens: int, n: int = 1,
                 prefix: tuple[int, ...] = (0,), **kw) -> Request:
    seqs = [Sequence(token_ids=list(prefix), num_hidden_tokens=1, index=i) for i in range(n)]
    encoder_input = [(sum(map(ord, rid)) + p) % 97 for p in range(encoder_len)]
    kw.setdefault("eos_token_ids", frozenset({EOS}))
    return Request(request_id=rid, encoder_len=encoder_len, encoder_input=encoder_input, seqs=seqs,
                   max_output_tokens=max_output_tokens, **kw)


def limits(max_batch_size=BIG, max_num_tokens=BIG, encoder_max_batch_size=BIG,
           encoder_max_num_tokens=BIG, tokens_per_block=4, encoder_max_num_tokens_while_decoding=0,
           encoder_max_num_tokens_per_decoding_row=0) -> SchedulerLimits:
    return SchedulerLimits(max_batch_size, max_num_tokens, encoder_max_batch_size,
                           encoder_max_num_tokens, tokens_per_block,
                           encoder_max_num_tokens_while_decoding=encoder_max_num_tokens_while_decoding,
                           encoder_max_num_tokens_per_decoding_row=encoder_max_num_tokens_per_decoding_row)


def check_blocks(sched: Scheduler) -> None:
    """Blocks used == blocks held by live sequences and running requests, none twice."""
    held_self = [b for r in sched.running for s in r.seqs for b in s.block_ids]
    held_cross = [b for r in sched.running for b in r.cross_block_ids]
    assert sched.self_pool.num_used_blocks == len(held_self) == len(set(held_self))
    assert sched.cross_pool.num_used_blocks == len(held_cross) == len(set(held_cross))
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING and not req.cross_block_ids
        # A sample that finished before the preemption keeps its count; it is never fed again.
        assert all(not s.block_ids and (s.num_computed_tokens == 0 or s.is_finished) for s in req.seqs)
    for req in sched.running:
        assert all(not s.block_ids for s in req.seqs if s.is_finished)


def check_limits(sched: Scheduler, so: SchedulerOutput, exclude_ended: bool = False) -> None:
    """``exclude_ended``: with overlap, a sequence whose last token is still a placeholder holds no
    row any more (it only waits for resolve() to end it)."""
    lim = sched.limits
    assert len(so.encodes) <= lim.encoder_max_batch_size
    assert so.num_encoder_tokens <= lim.encoder_max_num_tokens
    assert len(so.seqs) <= lim.max_batch_size
    assert sum(len(r.live_seqs) if not exclude_ended else
               sum(s.num_output_tokens < r.max_output_tokens for s in r.live_seqs)
               for r in sched.running) <= lim.max_batch_size
    assert so.num_encoder_tokens + so.num_decoder_tokens <= lim.max_num_tokens
    for s in so.seqs:   # block tables cover every position written this step
        assert len(s.block_ids) * lim.tokens_per_block >= s.seq_len


def run_all(sched: Scheduler, model, arrivals: dict[int, list[Request]], rng=None,
            abort_prob: float = 0.0, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Drive schedule -> execute -> update until idle; optionally abort at random."""
    outputs = []
    admitted_at: dict[str, int] = {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step > max(arrivals) and not sched.has_unfinished_requests():
            return outputs
        unfinished = [r.request_id for r in [*sched.waiting, *sched.running]]
        if rng is not None and rng.random() < abort_prob and unfinished:
            sched.abort_request(rng.choice(unfinished))
        so = sched.schedule()
        check_blocks(sched)
        check_limits(sched, so)
        assert not (so.preempted_request_ids and so.encodes), "admitted in a preempting step"
        for rid in so.preempted_request_ids:   # growth room was kept at admission
            assert admitted_at.get(rid) != step - 1, f"{rid} preempted right after admission"
        admitted_at.update((e.request_id, step) for e in so.encodes)
        outputs.append(so)
        ro = model.execute(so)
        if rng is not None and rng.random() < abort_prob and so.seqs:
            sched.abort_request(rng.choice(so.seqs).request_id)   # between schedule and update
        sched.update(so, ro)
        check_blocks(sched)
    raise AssertionError("the scheduler did not drain")


def random_workload(seed: int, num_requests: int = 60, max_n: int = 3) -> dict[int, list[Request]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    for i in range(num_requests):
        req = make_request(f"r{i}", rng.randint(1, 40), rng.randint(2, 40), n=rng.randint(1, max_n),
                           min_tokens=rng.choice([0, 0, 3]), ignore_eos=rng.random() < 0.2)
        arrivals.setdefault(rng.randint(0, 80), []).append(req)
    return arrivals


def all_requests(arrivals):
    return [r for reqs in arrivals.values() for r in reqs]


# ------------------------------------------------------------------------- (a) no torch

def test_policy_modules_do_not_import_torch():
    code = ("import sys, enc2dec.engine.core.scheduler, enc2dec.engine.core.block_manager, "
            "enc2dec.engine.core.kv_sizing; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------- (b) (c) random workloads

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_with_aborts_never_leaks_blocks(seed):
    tpb = 4
    sched = Scheduler(limits(max_batch_size=8, max_num_tokens=160, encoder_max_batch_size=3,
                             encoder_max_num_tokens=80, tokens_per_block=tpb), 40, 30)
    arrivals = random_workload(seed)
    run_all(sched, PagedFakeModel(40, 30, tpb), arrivals, rng=random.Random(seed), abort_prob=0.05)
    reqs = all_requests(arrivals)
    statuses = {r.status for r in reqs}
    assert RequestStatus.FINISHED_ABORTED in statuses and RequestStatus.FINISHED_LENGTH in statuses
    assert all(r.is_finished and r.status.is_finished for r in reqs)
    assert sched.self_pool.num_free_blocks == 40 and sched.cross_pool.num_free_blocks == 30
    assert not sched.waiting and not sched.running
    assert sched.num_preemptions > 0, "the pools were meant to be tight enough to preempt"


def test_admission_limits_hold_and_bind():
    lim = limits(max_batch_size=6, max_num_tokens=160, encoder_max_batch_size=2,
                 encoder_max_num_tokens=60, tokens_per_block=4)
    sched = Scheduler(lim, 500, 500)
    arrivals = random_workload(7, num_requests=80)
    outputs = run_all(sched, PagedFakeModel(500, 500, 4), arrivals)   # checks limits each step
    assert max(len(o.encodes) for o in outputs) == 2
    assert max(o.num_encoder_tokens for o in outputs) > 40
    assert max(len(o.seqs) for o in outputs) == 6
    assert any(o.encodes and len(o.seqs) > sum(len(e.seq_ids) for e in o.encodes) for o in outputs), \
        "steps must mix new encodes with ongoing decodes"


def test_steps_that_decode_encode_at_most_their_encoder_budget():
    # Whisper-like: every request is 30 encoder positions; a step that decodes encodes <= 35 of them.
    sched = Scheduler(limits(encoder_max_batch_size=4, encoder_max_num_tokens_while_decoding=35), 500, 500)
    model = PagedFakeModel(500, 500, 4)
    for i in range(6):
        sched.add_request(make_request(f"w{i}", 30, 6, ignore_eos=True))
    so = sched.schedule()
    assert len(so.encodes) == 4, "nothing decodes yet: the full encoder microbatch is admitted"
    sched.update(so, model.execute(so))
    encodes_per_step = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if so.seqs and len(so.seqs) > len(so.encodes):
            assert so.num_encoder_tokens <= 35
        encodes_per_step.append(len(so.encodes))
        sched.update(so, model.execute(so))
    assert encodes_per_step[:2] == [1, 1], "one clip per decoding step, and the queue still drains"
    # A request larger than the budget is still admitted, alone, so none waits for ever.
    sched = Scheduler(limits(encoder_max_num_tokens_while_decoding=10), 500, 500)
    sched.add_request(make_request("a", 30, 8, ignore_eos=True))
    sched.update(so := sched.schedule(), model.execute(so))
    sched.add_request(make_request("b", 30, 8, ignore_eos=True))
    sched.add_request(make_request("c", 30, 8, ignore_eos=True))
    so = sched.schedule()
    assert [e.request_id for e in so.encodes] == ["b"] and len(so.seqs) == 2


def test_an_encoder_bound_per_decoding_row_admits_more_as_more_rows_decode():
    # 30-position requests, 10 positions a decoding row: one request a step while under 6 rows
    # decode, then more as the batch grows; with a fixed bound of 60 as well, never over 2.
    def encodes_per_step(**bounds):
        sched = Scheduler(limits(**bounds), 5000, 5000)
        model, counts = PagedFakeModel(5000, 5000, 4), []
        sched.add_request(make_request("first", 8, 200, ignore_eos=True))
        sched.update(so := sched.schedule(), model.execute(so))
        for i in range(40):
            sched.add_request(make_request(f"r{i}", 30, 200, ignore_eos=True))
        while sched.waiting:
            so = sched.schedule()
            decoding = len(so.seqs) - len(so.encodes)       # the new requests decode in this step too
            cap = min(c for c in (bounds.get("encoder_max_num_tokens_while_decoding", 0),
                                  bounds["encoder_max_num_tokens_per_decoding_row"] * decoding) if c)
            assert len(so.encodes) == 1 or so.num_encoder_tokens <= cap
            counts.append(len(so.encodes))
            sched.update(so, model.execute(so))
        return counts

    counts = encodes_per_step(encoder_max_num_tokens_per_decoding_row=10)
    assert counts[:5] == [1, 1, 1, 1, 1] and counts[5] == 2, counts
    assert max(counts) >= 8 and sum(counts) == 40, "the queue drains faster as the batch grows"
    both = encodes_per_step(encoder_max_num_tokens_per_decoding_row=10, encoder_max_num_tokens_while_decoding=60)
    assert max(both) == 2 and both[:5] == counts[:5], "the smaller bound applies"


def test_encoder_microbatches_stay_inside_the_captured_encoder_graphs():
    # bart-large-cnn-like: 384-position inputs, an 8,192-token step; padded graphs hold a power of
    # two of inputs up to 512 positions long within 8,192 padded positions (16 x 512 at most).
    buckets = [(b, n) for b in (1, 2, 4, 8, 16, 32) for n in (64, 128, 256, 512, 1024) if b * n <= 8192]

    def positions(count, longest):
        return min((b * n for b, n in buckets if b >= count and n >= longest), default=None)

    def encodes_per_step(graphs, lengths, while_decoding=0):
        sched = Scheduler(limits(max_num_tokens=8192, encoder_max_num_tokens_while_decoding=while_decoding),
                          5000, 5000)
        sched.encoder_graph_positions = graphs
        model, counts = PagedFakeModel(5000, 5000, 4), []
        if while_decoding:      # one request decoding, so the bound applies from the next step on
            sched.add_request(make_request("first", 8, 64, ignore_eos=True))
            sched.update(so := sched.schedule(), model.execute(so))
        for i, n in enumerate(lengths):
            sched.add_request(make_request(f"r{i}", n, 4, ignore_eos=True))
        while sched.waiting:
            so = sched.schedule()
            check_limits(sched, so)
            counts.append(len(so.encodes))
            sched.update(so, model.execute(so))
        return counts

    assert encodes_per_step(None, [384] * 40)[:2] == [21, 19], "the token budget alone: 21 of 384 positions a step"
    assert encodes_per_step(positions, [384] * 40) == [16, 16, 8], "16 x 384 replays the 16 x 512 graph"
    # A longer input ends the microbatch where it would leave the graphs: 9 x 600 needs a 16 x 1024 graph.
    assert encodes_per_step(positions, [100] * 8 + [600] + [100] * 7)[0] == 8
    # An input no graph holds is still encoded, eagerly, so nothing waits for ever; the step's
    # others join it (an eager microbatch launches the same kernels whatever its size).
    assert encodes_per_step(positions, [2000, 100, 100]) == [3]
    # A bound on the encoder positions of a decoding step counts what the graph runs, padding
    # included: 10 of 384 (3,840 positions) would replay the 16 x 512 graph, so 8 (8 x 512) fit 4,096.
    assert encodes_per_step(None, [384] * 20, while_decoding=4096)[:2] == [10, 10]
    assert encodes_per_step(positions, [384] * 20, while_decoding=4096)[:2] == [8, 8]


def test_an_encoder_bound_per_decoding_row_counts_the_graphs_padded_positions():
    # bart-large-cnn's graphs (as above), 40 positions a decoding row: 384-position requests are
    # encoded 4 x 512 beside 52 decoding rows, 8 x 512 beside 103, and only 2 beside 51 (a
    # 3- or 4-request microbatch replays the 4 x 512 graph: 2,048 > 2,040).
    buckets = [(b, n) for b in (1, 2, 4, 8, 16, 32) for n in (64, 128, 256, 512, 1024) if b * n <= 8192]

    def positions(count, longest):
        return min((b * n for b, n in buckets if b >= count and n >= longest), default=None)

    def first_encodes(num_decoding):
        sched = Scheduler(limits(encoder_max_num_tokens_per_decoding_row=40), 50_000, 50_000)
        model = PagedFakeModel(50_000, 50_000, 4)
        for i in range(num_decoding):
            sched.add_request(make_request(f"d{i}", 8, 64, ignore_eos=True))
        sched.update(so := sched.schedule(), model.execute(so))
        assert len(so.encodes) == num_decoding
        sched.encoder_graph_positions = positions      # (the rows above were admitted in one go)
        for i in range(20):
            sched.add_request(make_request(f"r{i}", 384, 4, ignore_eos=True))
        so = sched.schedule()
        return len(so.encodes)

    assert [first_encodes(n) for n in (51, 52, 102, 103, 128)] == [2, 4, 4, 8, 8]


def test_token_budget_counts_encoder_and_decoder_tokens():
    sched = Scheduler(limits(max_num_tokens=30), 100, 100)
    model = PagedFakeModel(100, 100, 4)
    for rid in "ABC":   # each: 10 encoder positions + 1 decoder token on its first step
        sched.add_request(make_request(rid, 10, 5, ignore_eos=True))
    so = sched.schedule()
    assert [e.request_id for e in so.encodes] == ["A", "B"]   # 22 tokens; C would make 33
    sched.update(so, model.execute(so))
    so = sched.schedule()
    assert [e.request_id for e in so.encodes] == ["C"]
    assert so.num_encoder_tokens + so.num_decoder_tokens == 2 + 11


def test_decoding_sequences_count_against_the_token_budget():
    # Three running requests decode a token each (3 of the step's 12): a waiting request whose
    # first step costs 10 (9 encoder positions + 1 token) is admitted only once they have ended.
    sched = Scheduler(limits(max_num_tokens=12), 100, 100)
    arrivals = {0: [make_request(rid, 2, 3, ignore_eos=True) for rid in "ABD"]
                   + [make_request("C", 9, 3, ignore_eos=True)]}
    outputs = run_all(sched, PagedFakeModel(100, 100, 4), arrivals)        # checks every step's token budget
    step_c = next(i for i, so in enumerate(outputs) if any(e.request_id == "C" for e in so.encodes))
    assert step_c > 1 and all(not any(s.request_id in "ABD" for s in so.seqs) for so in outputs[step_c:])


# ---------------------------------------------------------------------- (d) preemption

def test_preemption_under_tiny_self_pool_gives_the_same_tokens():
    def run(num_self_blocks):
        sched = Scheduler(limits(max_batch_size=16, tokens_per_block=4), num_self_blocks, 1000)
        arrivals = random_workload(11, num_requests=40)
        run_all(sched, PagedFakeModel(num_self_blocks, 1000, 4), arrivals)
        reqs = all_requests(arrivals)
        result = {(r.request_id, s.index): (s.token_ids, s.status, s.cumulative_logprob,
                                            len(s.logprobs)) for r in reqs for s in r.seqs}
        return result, sched.num_preemptions, reqs

    reference, ref_preemptions, _ = run(10_000)
    tiny, num_preemptions, reqs = run(30)   # 3 sequences of 40 positions need 30 blocks
    assert ref_preemptions == 0 and num_preemptions > 5
    assert sum(r.num_preemptions for r in reqs) == num_preemptions
    assert len(tiny) == len(reference) == sum(len(r.seqs) for r in reqs)
    assert tiny == reference
    assert all(s.is_finished and s.status is not RequestStatus.FINISHED_ABORTED
               for r in reqs for s in r.seqs)


def test_preempted_request_returns_to_the_front_of_the_queue():
    # 3 self blocks of 4 positions. A and B take one block each; at step 4 both need a
    # second one and B (the newest) is preempted. C arrived just before and needs only 1
    # block, which is free, but the preempted B is ahead of it and does not fit until A ends.
    sched = Scheduler(limits(tokens_per_block=4), 3, 100)
    model = PagedFakeModel(3, 100, 4)
    a, b = make_request("A", 4, 8, ignore_eos=True), make_request("B", 4, 8, ignore_eos=True)
    c = make_request("C", 4, 3, ignore_eos=True)
    arrivals = {0: [a, b], 4: [c]}
    outputs = run_all(sched, model, arrivals)
    preempted = [(step, rid) for step, o in enumerate(outputs) for rid in o.preempted_request_ids]
    encoded = [e.request_id for o in outputs for e in o.encodes]
    assert preempted == [(4, "B")] and b.num_preemptions == 1
    assert encoded == ["A", "B", "B", "C"]
    assert [s.num_output_tokens for s in a.seqs + b.seqs + c.seqs] == [8, 8, 3]


# ---------------------------------------------------------------------- (e) cross pool

def test_cross_blocks_follow_encoder_length_and_are_shared_by_samples():
    sched = Scheduler(limits(tokens_per_block=32), 100, 100)
    req = make_request("whisper", 1500, 10, n=3, prefix=(50258, 50259, 50359, 50363))
    req.seqs = [Sequence(token_ids=[50258, 50259, 50359, 50363], num_hidden_tokens=4, index=i)
                for i in range(3)]
    sched.add_request(req)
    so = sched.schedule()
    assert len(so.encodes) == 1 and len(so.encodes[0].cross_block_ids) == 47
    assert sched.cross_pool.num_used_blocks == 47
    assert all(s.cross_block_ids == so.encodes[0].cross_block_ids for s in so.seqs)
    assert sched.self_pool.num_used_blocks == 3
    assert [s.input_token_ids for s in so.seqs] == [[50258, 50259, 50359, 50363]] * 3
    assert so.encodes[0].seq_indices == [0, 1, 2]
    sched.abort_request("whisper")
    assert sched.cross_pool.num_used_blocks == 0 and sched.self_pool.num_used_blocks == 0


# --------------------------------------------------------------------------- (f) FCFS

def test_big_waiting_request_is_not_overtaken():
    sched = Scheduler(limits(tokens_per_block=4), 100, 10)
    model = PagedFakeModel(100, 10, 4)
    sched.add_request(make_request("A", 24, 5, ignore_eos=True))    # 6 of 10 cross blocks
    so = sched.schedule()
    admitted = [e.request_id for e in so.encodes]
    sched.update(so, model.execute(so))
    sched.add_request(make_request("big", 32, 3, ignore_eos=True))  # needs 8: waits for A
    sched.add_request(make_request("small", 4, 3, ignore_eos=True))  # 1 would fit now
    num_steps_blocked = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        admitted += [e.request_id for e in so.encodes]
        num_steps_blocked += "big" not in admitted
        if "big" not in admitted:
            assert "small" not in admitted
        sched.update(so, model.execute(so))
    assert admitted == ["A", "big", "small"] and num_steps_blocked >= 3


# ----------------------------------------------------------------------- (g) stop rules

def run_one(req: Request, script, max_steps: int = 50) -> Request:
    sched = Scheduler(limits(tokens_per_block=4), 100, 100)
    sched.add_request(req)
    model = ScriptedModel(script)
    for _ in range(max_steps):
        so = sched.schedule()
        sched.update(so, model.execute(so))
        if not sched.has_unfinished_requests():
            assert sched.self_pool.num_used_blocks == sched.cross_pool.num_used_blocks == 0
            return req
    raise AssertionError("did not finish")


def test_eos_stops_and_is_included():
    req = run_one(make_request("r", 5, 10), [5, EOS, 7, 8])
    assert req.seqs[0].output_token_ids == [5, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.seqs[0].stop_reason is None


def test_ignore_eos_continues_to_length():
    req = run_one(make_request("r", 5, 4, ignore_eos=True), [5, EOS, 7, 8, 9])
    assert req.seqs[0].output_token_ids == [5, EOS, 7, 8]
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_delays_eos():
    req = run_one(make_request("r", 5, 10, min_tokens=3), [EOS, EOS, EOS, 5])
    assert req.seqs[0].output_token_ids == [EOS, EOS, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_also_delays_stop_token_ids():
    req = run_one(make_request("r", 5, 10, min_tokens=2, stop_token_ids=frozenset({7})), [7, 7, 5])
    assert req.seqs[0].output_token_ids == [7, 7] and req.seqs[0].stop_reason == 7


def test_stop_token_ids_set_stop_reason():
    req = run_one(make_request("r", 5, 10, stop_token_ids=frozenset({7})), [5, 6, 7, 8])
    assert req.seqs[0].output_token_ids == [5, 6, 7]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.seqs[0].stop_reason == 7


def test_max_output_tokens_gives_length_and_counts_forced_bos():
    req = make_request("r", 5, 3, prefix=(0, 2))   # [decoder_start, forced_bos]
    run_one(req, [2, 5, 6, 8, 9])
    assert req.seqs[0].output_token_ids == [2, 5, 6]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.status.finish_reason == "length"


def test_logprobs_accumulate():
    sched = Scheduler(limits(), 10, 10)
    req = make_request("r", 3, 2)
    sched.add_request(req)
    for logprob in (-0.5, -1.0):
        so = sched.schedule()
        assert len(so.seqs) == 1
        sched.update(so, ModelRunnerOutput([5], logprobs=[logprob], top_logprobs=[{5: logprob, 6: -3.0}]))
    seq = req.seqs[0]
    assert seq.cumulative_logprob == -1.5
    assert seq.logprobs == [{5: -0.5, 6: -3.0}, {5: -1.0, 6: -3.0}]
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_samples_finish_independently_and_free_their_own_blocks():
    sched = Scheduler(limits(tokens_per_block=4), 100, 100)
    req = make_request("r", 8, 10, n=2)
    sched.add_request(req)
    model = ScriptedModel({0: [5, EOS], 1: [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]})
    for _ in range(2):
        so = sched.schedule()
        sched.update(so, model.execute(so))
    assert req.seqs[0].status is RequestStatus.FINISHED_STOPPED and not req.seqs[0].block_ids
    assert req.status is RequestStatus.RUNNING and sched.cross_pool.num_used_blocks == 2
    assert sched.self_pool.num_used_blocks == len(req.seqs[1].block_ids) == 1
    so = sched.schedule()
    assert [s.seq_id for s in so.seqs] == [req.seqs[1].seq_id]
    finished = sched.update(so, model.execute(so))
    while not finished:
        so = sched.schedule()
        finished = sched.update(so, model.execute(so))
    assert finished == [req] and req.status is RequestStatus.FINISHED_LENGTH
    assert req.seqs[0].status is RequestStatus.FINISHED_STOPPED
    assert sched.self_pool.num_used_blocks == sched.cross_pool.num_used_blocks == 0
    assert sched.schedule().is_empty


def test_finish_seq_for_stop_strings():
    sched = Scheduler(limits(), 100, 100)
    req = make_request("r", 8, 10, n=2)
    sched.add_request(req)
    so = sched.schedule()
    sched.update(so, ScriptedModel({0: [5], 1: [6]}).execute(so))
    assert sched.finish_seq(req.seqs[0], RequestStatus.FINISHED_STOPPED, "###") is None
    assert req.seqs[0].stop_reason == "###" and not req.seqs[0].block_ids
    assert sched.finish_seq(req.seqs[1].seq_id, RequestStatus.FINISHED_STOPPED, "###") is req
    assert sched.finish_seq(req.seqs[1].seq_id, RequestStatus.FINISHED_STOPPED) is None
    assert req.status is RequestStatus.FINISHED_STOPPED and not sched.has_unfinished_requests()
    assert sched.self_pool.num_used_blocks == sched.cross_pool.num_used_blocks == 0


# --------------------------------------------------------------------------- aborts

def test_abort_waiting_request_is_reported_with_the_next_step():
    sched = Scheduler(limits(encoder_max_batch_size=1), 100, 100)
    sched.add_request(make_request("a", 4, 5))
    sched.add_request(make_request("b", 4, 5))
    so = sched.schedule()
    assert [e.request_id for e in so.encodes] == ["a"]
    aborted = sched.abort_request("b")
    assert aborted.status is RequestStatus.FINISHED_ABORTED
    assert all(s.status is RequestStatus.FINISHED_ABORTED for s in aborted.seqs)
    assert sched.abort_request("b") is None and sched.abort_request("nope") is None
    sched.update(so, ScriptedModel([5] * 5).execute(so))
    assert sched.schedule().finished_request_ids == ["b"]


def test_abort_between_schedule_and_update_skips_the_token():
    sched = Scheduler(limits(), 100, 100)
    req = make_request("a", 4, 5)
    sched.add_request(req)
    so = sched.schedule()
    sched.abort_request("a")
    assert sched.update(so, ScriptedModel([5] * 5).execute(so)) == []
    assert req.seqs[0].token_ids == [0]
    assert sched.self_pool.num_used_blocks == sched.cross_pool.num_used_blocks == 0
    assert sched.schedule().finished_request_ids == []   # empty step: held for the next real one
    sched.add_request(make_request("b", 4, 5))
    assert sched.schedule().finished_request_ids == ["a"]


# ------------------------------------------------------------------ (h) check_admissible

@pytest.mark.parametrize("req_kw, lim_kw, expected", [
    (dict(encoder_len=65), dict(encoder_max_num_tokens=64), "encoder_max_num_tokens=64"),
    (dict(encoder_len=65), dict(max_num_tokens=64), "max_num_tokens=64"),
    (dict(encoder_len=40, max_output_tokens=30), dict(max_num_tokens=64), "after a preemption"),
    (dict(n=5), dict(max_batch_size=4), "max_batch_size=4"),
    (dict(encoder_len=41), {}, "cross_kv_cache_fraction"),          # 11 cross blocks > 10
    (dict(max_output_tokens=41), {}, "self pool has 10"),           # 41 positions = 11 blocks
    (dict(n=3, max_output_tokens=16), {}, "12 self-attention KV blocks"),
    (dict(max_output_tokens=1, prefix=(0, 2)), {}, "max_tokens=1"),
])
def test_check_admissible_explains_impossible_requests(req_kw, lim_kw, expected):
    req_kw = {"encoder_len": 8, "max_output_tokens": 8, **req_kw}
    sched = Scheduler(limits(**lim_kw), 10, 10)
    req = make_request("r", **req_kw)
    reason = sched.check_admissible(req)
    assert reason is not None and expected in reason, reason
    with pytest.raises(ValueError, match="."):
        sched.add_request(req)
    assert not sched.has_unfinished_requests()


def test_check_admissible_accepts_exact_fits():
    sched = Scheduler(limits(max_num_tokens=80, encoder_max_num_tokens=40, max_batch_size=1), 10, 10)
    # 40 encoder positions = 10 cross blocks; 1 + 40 - 1 = 40 decoder positions = 10 self blocks.
    req = make_request("r", 40, 40)
    assert sched.check_admissible(req) is None
    sched.add_request(req)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", 4, 4))


def test_limits_reject_non_positive_values():
    with pytest.raises(ValueError, match="encoder_max_batch_size"):
        limits(encoder_max_batch_size=0)
