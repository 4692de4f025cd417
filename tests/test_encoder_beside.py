"""The encoder beside the decoder: a request admitted while others decode is encoded on a
second stream beside the next decode step and joins the batch one step later, in a step that
waits for that encoder; the running sequences never wait for it, and its tokens are those of
the engine that encodes inside the step."""
import random

import pytest

from enc2dec.engine import KvCacheConfig, LlmArgs, SamplingParams, TuningConfig
from enc2dec.engine.core.batch import SchedulerOutput
from enc2dec.engine.core.scheduler import Scheduler
from enc2dec.engine.engine_core import EngineCore
from enc2dec.engine.runner import model_runner

from test_scheduler import (PagedFakeModel, all_requests, check_blocks, check_limits, limits, make_request,
                            random_workload)


class SideStreamModel(PagedFakeModel):
    """The fake model with a second stream: a deferred encode's cross K/V lands at some later
    step, in ticket order, and at the latest when a step waits for it (``join_ticket``), as on
    the GPU. A decode that reads a slot not written yet, or still holding an earlier request's
    K/V, fails the test."""

    def __init__(self, *args, rng: random.Random):
        super().__init__(*args)
        self.rng = rng
        self.in_flight: list[tuple[int, list]] = []      # (ticket, writes), in order

    def _land(self, up_to: float) -> None:
        while self.in_flight and self.in_flight[0][0] <= up_to:
            for slot, value in self.in_flight.pop(0)[1]:
                self.cross_kv[slot] = value

    def execute(self, so: SchedulerOutput):
        writes = [(self._slot(e.cross_block_ids, pos), (e.request_id, tok))
                  for e in so.encodes if not e.reuses_cross_kv for pos, tok in enumerate(e.encoder_input)]
        for e in so.encodes:
            self.seq_index.update(zip(e.seq_ids, e.seq_indices))
        if self.in_flight and self.rng.random() < 0.3:        # the side stream got ahead on its own
            self._land(self.in_flight[0][0])
        self._land(so.join_ticket)                            # this step waits for those
        if so.encode_ticket:
            self.in_flight.append((so.encode_ticket, writes))
        elif writes:   # this step decodes its encodes: it waits for everything on the side stream
            self.in_flight.append((float("inf"), writes))
            self._land(float("inf"))
        for s in so.seqs:
            for p in range(s.encoder_len):
                value = self.cross_kv[self._slot(s.cross_block_ids, p)]
                assert value is not None and value[0] == s.request_id, \
                    f"{s.request_id} decoded before its encoder had run"
        saved = self.cross_kv
        self.cross_kv = [v if v is None else v[1] for v in saved]
        try:
            return super().execute(SchedulerOutput(seqs=so.seqs))
        finally:
            self.cross_kv = saved


def _run(sched: Scheduler, model, arrivals, rng: random.Random, abort_prob: float = 0.0) -> list[SchedulerOutput]:
    outputs = []
    for step in range(20_000):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step > max(arrivals) and not sched.has_unfinished_requests():
            return outputs
        unfinished = [r.request_id for r in [*sched.waiting, *sched.running]]
        if abort_prob and rng.random() < abort_prob and unfinished:
            sched.abort_request(rng.choice(unfinished))
        so = sched.schedule()
        check_blocks(sched)
        check_limits(sched, so)
        outputs.append(so)
        sched.update(so, model.execute(so))
    raise AssertionError("the scheduler did not drain")


def _tokens(arrivals):
    return {(r.request_id, s.index): (s.token_ids, s.status) for r in all_requests(arrivals) for s in r.seqs}


@pytest.mark.parametrize("seed,join_steps", [(3, 1), (7, 1), (7, 3)])
@pytest.mark.parametrize("num_self_blocks", [10_000, 40])
def test_deferred_joins_give_the_same_tokens_and_never_read_an_unwritten_encoder(seed, join_steps, num_self_blocks):
    """Random arrivals, n > 1, and (with 40 self blocks) preemptions, some of a request whose
    encode is still in flight: readmitted, it must wait for its new encode, not the old one.
    With several join steps (tuning.encoder_join_steps) encodes of consecutive steps overlap."""
    def run(defer: bool):
        lim = limits(max_batch_size=12, tokens_per_block=4)
        if defer:
            lim = type(lim)(**{**lim.__dict__, "defer_joins_while_decoding": join_steps})
        sched = Scheduler(lim, num_self_blocks, 1000)
        arrivals = random_workload(seed, num_requests=40)
        rng = random.Random(seed)
        model = SideStreamModel(num_self_blocks, 1000, 4, rng=rng) if defer else PagedFakeModel(num_self_blocks, 1000, 4)
        outputs = _run(sched, model, arrivals, rng)
        return _tokens(arrivals), outputs, sched

    reference, _, _ = run(False)
    tokens, outputs, sched = run(True)
    assert tokens == reference
    deferred = [o for o in outputs if o.encode_ticket]
    assert len(deferred) > 5, "the workload never admitted a request while others decoded"
    for o in deferred:           # nothing encoded in a deferring step decodes in it, unless cached
        joined = {s.request_id for s in o.seqs}
        assert not joined & {e.request_id for e in o.encodes if not e.reuses_cross_kv}
    if num_self_blocks == 40:
        assert sched.num_preemptions > 0


def test_a_request_admitted_into_an_idle_engine_decodes_in_its_encode_step():
    """Nobody waits for the encoder then: deferring would only add a step to its first token."""
    lim = type(limits())(**{**limits().__dict__, "defer_joins_while_decoding": 1})
    sched = Scheduler(lim, 1000, 1000)
    sched.add_request(make_request("a", 4, 5, ignore_eos=True))
    so = sched.schedule()
    assert so.encode_ticket == 0 and [s.request_id for s in so.seqs] == ["a"]


def test_aborts_while_encodes_are_in_flight_leak_nothing():
    rng = random.Random(5)
    lim = type(limits())(**{**limits(max_batch_size=8).__dict__, "defer_joins_while_decoding": 1})
    sched = Scheduler(lim, 200, 1000)
    arrivals = random_workload(5, num_requests=40)
    _run(sched, SideStreamModel(200, 1000, 4, rng=rng), arrivals, rng, abort_prob=0.2)
    assert sched.self_pool.num_used_blocks == 0 and sched.cross_pool.num_used_blocks == 0


def _drain(core: EngineCore, prompts, params) -> dict:
    """Submit every prompt to the engine loop, step it until all finish, shut it down: {id: tokens}."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add(core.make_request(p, sp, request_id=f"r{i}"))
    results, steps = {}, 0
    while core.has_work():
        results.update((o.request_id, o.outputs[0].token_ids) for o in core.step() if o.finished)
        steps += 1
        assert steps < 500
    core.shutdown()
    return results


@pytest.mark.parametrize("overlap,join_steps", [(True, 1), (False, 1), (True, 3)])
def test_engine_with_deferred_joins_matches_the_engine_without(flan_t5, monkeypatch, overlap, join_steps):
    """The real engine loop and runner on the CPU (which has no second stream: its encodes run in
    the step, their tickets done at once): more requests than batch rows, so most are
    admitted while others decode; the tokens equal those of the engine that never defers."""
    prompts = [f"translate English to German: sentence number {i} is here" for i in range(9)]
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True) for i in range(9)]

    def run(beside: bool):
        monkeypatch.setattr(model_runner, "encodes_beside", lambda args, device, tp: beside)
        core = EngineCore(LlmArgs(model=flan_t5, dtype="float32", max_batch_size=3,
                                  disable_overlap_scheduler=not overlap,
                                  tuning=TuningConfig(encoder_join_steps=join_steps),
                                  kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4,
                                                                max_cpu_memory_bytes=64 << 20)))
        assert core.limits.defer_joins_while_decoding == (join_steps if beside else 0)
        tickets = []
        launch = core.runner.launch
        core.runner.launch = lambda so: (tickets.append(so.encode_ticket), launch(so))[1]
        results = _drain(core, prompts, params)
        return results, tickets

    reference, no_tickets = run(False)
    results, tickets = run(True)
    assert not any(no_tickets)
    assert sum(1 for t in tickets if t) >= 3
    assert results == reference and len(results) == len(prompts)


def test_an_engine_bounding_encodes_per_decoding_row_gives_the_same_tokens(flan_t5):
    """tuning.encoder_tokens_per_decoding_row reaches the scheduler: a step that decodes n rows
    encodes one request, or at most n x the bound's positions; the tokens are those of the
    unbounded engine."""
    prompts = [f"translate English to German: sentence number {i} is here" for i in range(9)]
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True) for i in range(9)]

    def run(per_row: int):
        core = EngineCore(LlmArgs(model=flan_t5, dtype="float32", max_batch_size=6,
                                  tuning=TuningConfig(encoder_tokens_per_decoding_row=per_row),
                                  kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4,
                                                                max_cpu_memory_bytes=64 << 20)))
        assert core.limits.encoder_max_num_tokens_per_decoding_row == per_row
        steps, launch = [], core.runner.launch

        def counted(so):
            new = {e.request_id for e in so.encodes}
            steps.append((len(so.encodes), so.num_encoder_tokens, sum(s.request_id not in new for s in so.seqs)))
            return launch(so)
        core.runner.launch = counted
        return _drain(core, prompts, params), steps

    reference, free_steps = run(0)
    results, steps = run(8)          # a prompt is ~14 positions: two rows' worth for each request
    assert results == reference and len(results) == len(prompts)
    assert all(n <= 1 or decoding == 0 or positions <= 8 * decoding for n, positions, decoding in steps)
    assert max(n for n, _, decoding in free_steps if decoding) > max(n for n, _, decoding in steps if decoding), \
        "the bound admits fewer requests beside few decoding rows than the unbounded engine"


@pytest.mark.parametrize("name,beside,expected", [
    ("openai/whisper-large-v3-turbo", True, (3000, 2)),     # 4 decoder layers to 32 encoder layers
    ("distil-whisper/distil-large-v3", True, (3000, 2)),
    ("openai/whisper-large-v3", True, (1500, 1)),
    ("openai/whisper-small", True, (1500, 1)),
    ("openai/whisper-large-v3-turbo", False, (1500, 0)),    # CPU, tensor parallel: encodes in the step
    ("google/flan-t5-large", True, (0, 1)),
])
def test_auto_encoder_admission_of_the_real_configs(name, beside, expected):
    """Two clips a decoding step, joining two steps later, only for a Whisper whose encoder
    outweighs its decoder and is encoded beside it; what tuning sets wins."""
    from enc2dec.engine.core.admission import encoder_admission
    from enc2dec.engine.inputs.known_configs import get_known_config

    cfg = get_known_config(name)
    whisper = cfg.model_type == "whisper"
    layers = (cfg.encoder_layers, cfg.decoder_layers) if whisper else (cfg.num_layers, cfg.num_decoder_layers)
    assert encoder_admission(TuningConfig(), whisper, *layers, 1500 if whisper else 512, beside) == expected
    set_ = TuningConfig(encoder_tokens_while_decoding=4500, encoder_join_steps=3)
    assert encoder_admission(set_, whisper, *layers, 1500, beside) == (4500, 3 if beside else 0)


def test_an_encoder_heavy_whisper_engine_admits_two_clips_a_step_and_matches_the_engine_without(
        whisper, tmp_path, monkeypatch):
    """The engine loop on the CPU with a Whisper of 4 encoder layers and 1 decoder layer (dummy
    weights, the same for both engines): beside the decoder it admits two clips while decoding
    and joins them two steps later; its tokens equal those of the engine that encodes in the step."""
    import json
    import shutil

    import numpy as np

    heavy = tmp_path / "heavy"
    shutil.copytree(whisper, heavy)
    cfg = json.loads((heavy / "config.json").read_text())
    cfg.update(encoder_layers=4, decoder_layers=1)
    (heavy / "config.json").write_text(json.dumps(cfg))
    prompts = [{"multi_modal_data": {"audio": [(np.random.default_rng(i).standard_normal(8000 * (1 + i % 3))
                                                .astype(np.float32) * 0.1, 16000)]}} for i in range(8)]
    # in pairs of equal lengths: two requests finish in a step, so two wait to be admitted in the next
    params = [SamplingParams(max_tokens=3 + i // 2 % 3, temperature=0.0, ignore_eos=True) for i in range(8)]

    def run(beside: bool):
        monkeypatch.setattr(model_runner, "encodes_beside", lambda args, device, tp: beside)
        core = EngineCore(LlmArgs(model=str(heavy), load_format="dummy", dtype="float32", max_batch_size=4,
                                  kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5,
                                                                max_cpu_memory_bytes=256 << 20)))
        lim = core.limits
        assert (lim.encoder_max_num_tokens_while_decoding, lim.defer_joins_while_decoding) == \
            ((3000, 2) if beside else (1500, 0))
        encodes = []
        launch = core.runner.launch

        def counted(so):    # (clips encoded, whether the step also decodes requests admitted before)
            new = {e.request_id for e in so.encodes}
            encodes.append((len(new), any(s.request_id not in new for s in so.seqs)))
            return launch(so)
        core.runner.launch = counted
        results = _drain(core, prompts, params)
        return results, encodes

    reference, in_step = run(False)
    results, encodes = run(True)
    assert max(n for n, decoding in in_step if decoding) == 1
    assert max(n for n, decoding in encodes if decoding) == 2      # two clips beside a decode step
    assert results == reference and len(results) == len(prompts)


def test_a_request_preempted_during_its_encode_waits_for_its_new_one():
    """Its first encode's turn coming must not let it join: the cross blocks it holds now are
    written by the second encode, which may still be running."""
    lim = type(limits())(**{**limits().__dict__, "defer_joins_while_decoding": 2})
    sched = Scheduler(lim, 1000, 1000)
    a, b = make_request("a", 4, 50, ignore_eos=True), make_request("b", 4, 50, ignore_eos=True)
    sched.add_request(a)
    sched.advance(sched.schedule())            # a decodes (placeholders: nothing resolves here)
    sched.add_request(b)
    first = sched.schedule()
    assert first.encode_ticket and b.encode_pending == first.encode_ticket
    assert "b" not in {s.request_id for s in first.seqs}
    sched.advance(first)
    sched._preempt(b)                          # as the pool running short would
    second = sched.schedule()                  # readmitted: a second ticket
    assert [e.request_id for e in second.encodes] == ["b"] and second.encode_ticket > first.encode_ticket
    sched.advance(second)
    third = sched.schedule()                   # the first ticket's turn: b still waits
    assert "b" not in {s.request_id for s in third.seqs} and third.join_ticket < second.encode_ticket
    sched.advance(third)
    fourth = sched.schedule()
    assert "b" in {s.request_id for s in fourth.seqs} and fourth.join_ticket == second.encode_ticket


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["flan_t5", "whisper"])
def test_on_the_gpu_encodes_beside_the_decoder_give_the_same_tokens_without_syncing(checkpoint, request):
    """On the second stream for real (CUDA graphs on both sides for Whisper): more requests than
    rows, lengths spread, every step under the sync debug mode; the tokens equal those of the
    engine that encodes inside the step."""
    import numpy as np
    import torch
    from gpu_sync import syncs_raise

    from enc2dec.engine import LLM, TuningConfig

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = request.getfixturevalue(checkpoint)
    if checkpoint == "whisper":
        prompts = [{"multi_modal_data": {"audio": [(np.random.default_rng(i).standard_normal(16000 * (1 + i % 3))
                                                    .astype(np.float32) * 0.1, 16000)]}} for i in range(10)]
    else:
        prompts = [f"translate English to German: sentence number {i} is here" for i in range(10)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(10)]
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)

    def run(beside: bool):
        with LLM(path, dtype="bfloat16", max_batch_size=4, kv_cache_config=kv,
                 tuning=TuningConfig(encoder_beside_decoder=beside)) as llm:
            core = llm.engine
            assert core.runner.encodes_beside is beside
            if beside:       # not torch's shared capture stream, whose cuBLAS workspace decoder graphs use
                assert core.runner.encoder_graphs.capture_stream is core.runner._encode_stream is not None
            llm.generate(prompts[:2], params[:2], use_tqdm=False)          # warm-up: lazy init may sync once
            inner, launch, tickets = core.step, core.runner.launch, []

            def strict_step():
                with syncs_raise():
                    return inner()

            core.step = strict_step
            core.runner.launch = lambda so: (tickets.append(so.encode_ticket), launch(so))[1]
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                core.step, core.runner.launch = inner, launch
            return [o.outputs[0].token_ids for o in outs], tickets

    reference, no_tickets = run(False)
    tokens, tickets = run(True)
    assert not any(no_tickets) and sum(1 for t in tickets if t) >= 3
    assert tokens == reference
