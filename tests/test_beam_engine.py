"""Beam search in the engine loop: KV pool accounting, copy-on-write sharing, preemption,
aborts, the overlap scheduler, and request validation. Runs EngineCore by hand (no thread)
so a test can look at the pools between steps."""
import random

import pytest

from enc2dec.engine import LLM, KvCacheConfig, LlmArgs, SamplingParams
from enc2dec.engine.core.block_manager import blocks_needed
from enc2dec.engine.engine_core import EngineCore

TPB = 4
PROMPTS = [
    "translate English to German: The house is wonderful.",
    "hello",
    "a b c d e f g h i j k l m n o p",
    "summarize: studies have shown that owning a dog is good for you",
    "machine translation is fun and useful",
    "un chat noir dort sur le canapé",
]


def _core(path, kv_bytes=64 << 20, cross_fraction=0.5, **kw) -> EngineCore:
    args = LlmArgs(model=path, dtype="float32", max_batch_size=16, max_beam_width=4,
                   kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=cross_fraction, tokens_per_block=TPB,
                                                 max_cpu_memory_bytes=kv_bytes), **kw)
    return EngineCore(args)


def _beam(k, n=1, max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, use_beam_search=True, best_of=k, n=n, **kw)


def _run(core, submissions, abort_at=None):
    """submissions: [(step, rid, prompt, params)]; abort_at: {step: [rid]}. Returns finished outputs by id."""
    abort_at = abort_at or {}
    results, step = {}, 0
    pending = sorted(submissions, key=lambda s: s[0])
    while pending or core.has_work():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            core.add(core.make_request(prompt, params, request_id=rid))
        for rid in abort_at.get(step, []):
            out = core.abort(rid)
            if out is not None:
                results[rid] = out
        for out in core.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
        assert step < 2000, "engine did not drain"
    return results


def test_beams_share_one_cross_allocation_and_their_full_blocks(bart):
    core = _core(bart, disable_overlap_scheduler=True)
    sched = core.scheduler
    tracked = core.make_request(PROMPTS[2], _beam(4, max_tokens=12, ignore_eos=True))
    core.add(tracked)
    req = tracked.request
    num_cross = blocks_needed(req.encoder_len, TPB)
    seen_copies = seen_shared = 0
    while core.has_work():
        core.step()
        if req.is_finished:
            break
        assert sched.cross_pool.num_used_blocks == num_cross          # once per request, not per beam
        assert len(req.seqs) == (1 if req.seqs[0].num_output_tokens <= 1 else 4)
        blocks = [b for s in req.seqs for b in s.block_ids]
        num_private = len(set(blocks))
        assert sched.self_pool.num_used_blocks == num_private          # no block lost between beams
        seen_shared += len(blocks) - num_private
        seen_copies += sum(sched.self_pool.ref_count(b) > 1 for b in set(blocks))
    assert seen_shared > 0 and seen_copies > 0                         # full blocks were shared by ref count
    assert sched.self_pool.num_used_blocks == 0 and sched.cross_pool.num_used_blocks == 0


def test_copy_on_write_copies_only_a_partly_filled_block(bart, monkeypatch):
    core = _core(bart, disable_overlap_scheduler=True)
    copies = []
    launch = core.runner.launch

    def spy(so):
        copies.append((so.block_copies, {s.seq_id: s.start_pos for s in so.seqs}))
        return launch(so)

    monkeypatch.setattr(core.runner, "launch", spy)
    _run(core, [(0, "r", PROMPTS[0], _beam(4, max_tokens=12, ignore_eos=True))])
    assert any(c for c, _ in copies)
    for block_copies, positions in copies:
        for src, dst in block_copies:
            assert src != dst
        if block_copies:
            # A copy is made only when the position written this step falls inside a block.
            assert all(pos % TPB != 0 for pos in positions.values())


def _workload(seed):
    rng = random.Random(seed)
    subs, aborts = [], {}
    for i in range(16):
        kind = rng.choice(["beam", "beam", "greedy"])
        ignore_eos = rng.random() < 0.5      # long beams: the self pool runs out mid-flight
        params = (_beam(rng.choice([2, 3, 4]), n=1, max_tokens=rng.randint(4, 16), ignore_eos=ignore_eos,
                        length_penalty=rng.choice([1.0, 0.5]), early_stopping=rng.choice([False, True, "never"]))
                  if kind == "beam" else SamplingParams(max_tokens=rng.randint(3, 16), temperature=0.0,
                                                        ignore_eos=ignore_eos))
        if kind == "beam" and rng.random() < 0.5:
            params.n = params.best_of
        subs.append((rng.randint(0, 4), f"r{i}", rng.choice(PROMPTS), params))
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(1, 20), []).append(f"r{i}")
    return subs, aborts


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_workload_with_aborts_and_preemption_leaks_nothing(bart_eos_engine, seed):
    subs, aborts = _workload(seed)
    roomy = _run(_core(bart_eos_engine), subs)          # no aborts, no pressure: the reference
    tight = _core(bart_eos_engine, kv_bytes=80 << 10, cross_fraction=0.6)   # a few requests' worth
    got = _run(tight, subs, aborts)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid, out in got.items():
        assert out.finished
        params = next(p for _, r, _, p in subs if r == rid)
        if rid in aborted and out.outputs[0].finish_reason == "abort":
            continue
        assert [(o.token_ids, o.finish_reason) for o in out.outputs] == \
            [(o.token_ids, o.finish_reason) for o in roomy[rid].outputs], rid
        assert len(out.outputs) == (params.n if params.use_beam_search else 1)
    assert set(got) == {rid for _, rid, _, _ in subs}
    assert tight.scheduler.self_pool.num_used_blocks == 0
    assert tight.scheduler.cross_pool.num_used_blocks == 0


def test_preempted_beam_search_resumes_with_the_same_hypotheses(bart):
    subs = [(0, f"r{i}", p, _beam(4, n=4, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(["hello", "hello world", "the lazy dog"])]
    roomy = _run(_core(bart), subs)
    # 8 cross and 12 self blocks: all three are admitted, then their beams outgrow the pool.
    tight = _core(bart, kv_bytes=40 << 10, cross_fraction=0.4)
    got = _run(tight, subs)
    assert tight.scheduler.num_preemptions > 0
    for rid, out in got.items():
        ref = roomy[rid].outputs
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref]
        # Recomputed after preemption in a smaller batch, the float32 scores may differ in the
        # last bit (the CPU GEMM picks its kernel by batch shape); the ranking may not.
        assert [o.cumulative_logprob for o in out.outputs] == \
            pytest.approx([o.cumulative_logprob for o in ref], rel=1e-6, abs=0)
    assert tight.scheduler.self_pool.num_used_blocks == 0 and tight.scheduler.cross_pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def bart_eos_engine(bart, tmp_path_factory):
    from test_beam_search import _eos_heavy

    return _eos_heavy(bart, str(tmp_path_factory.mktemp("bart_eos_engine")))


def test_overlap_scheduler_gives_the_same_results(bart_eos_engine):
    subs, _ = _workload(3)
    with_overlap = _run(_core(bart_eos_engine), subs)
    without = _run(_core(bart_eos_engine, disable_overlap_scheduler=True), subs)
    assert {rid: [o.token_ids for o in out.outputs] for rid, out in with_overlap.items()} == \
        {rid: [o.token_ids for o in out.outputs] for rid, out in without.items()}


# ------------------------------------------------------------------------------ validation

@pytest.fixture(scope="module")
def llm(bart):
    with LLM(bart, dtype="float32", max_batch_size=8, max_beam_width=4,
             kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=TPB,
                                           max_cpu_memory_bytes=16 << 20)) as llm:
        yield llm


@pytest.mark.parametrize("params, match", [
    (dict(best_of=8, n=1), r"best_of=8 .*exceeds max_beam_width=4"),
    (dict(best_of=2, n=2, temperature=0.7), "temperature"),
    (dict(best_of=2, n=1, stop=["x"]), "stop strings"),
    (dict(best_of=2, n=1, min_p=0.1), "min_p"),
])
def test_bad_beam_request_is_refused_at_submit_and_good_ones_go_on(llm, params, match):
    good = llm.generate_async(PROMPTS[0], _beam(4, n=2, max_tokens=6))
    with pytest.raises(ValueError, match=match):
        llm.generate_async(PROMPTS[1], SamplingParams(max_tokens=6, use_beam_search=True, **params))
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], PROMPTS[1]], [_beam(2), SamplingParams(max_tokens=6, use_beam_search=True,
                                                                         **params)], use_tqdm=False)
    out = good.result(timeout=120)
    assert len(out.outputs) == 2 and all(o.finish_reason in ("stop", "length") for o in out.outputs)


def test_n_above_best_of_names_both():
    with pytest.raises(ValueError, match=r"n \(5\) must not exceed best_of \(4\)"):
        SamplingParams(use_beam_search=True, best_of=4, n=5)


def test_beam_outputs_carry_cumulative_logprobs_and_streaming_ends_with_them(llm):
    handle = llm.generate_async(PROMPTS[3], _beam(3, n=3, max_tokens=8, logprobs=0), streaming=True)
    updates = list(handle)
    assert len(updates) == 1 and updates[0].finished            # beams reorder: one final output
    outs = updates[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    for o in outs:
        # BART's forced BOS is part of the prefix, not sampled: no logprob entry (as with greedy).
        assert o.cumulative_logprob < 0 and len(o.logprobs) == len(o.token_ids) - 1
        per_token = [lp[t] for lp, t in zip(o.logprobs, o.token_ids[1:])]
        assert sum(per_token) == pytest.approx(o.cumulative_logprob, abs=1e-4)
    ranked = [o.cumulative_logprob / len(o.token_ids) for o in outs]
    assert ranked == sorted(ranked, reverse=True)
