"""Overlap per request in the engine loop: a beam search or a request whose Python logits
processor reads ids pauses alone while its step is in flight; the greedy requests beside it
keep one token per engine step, and every output equals the one without overlap."""
import pytest

from enc2dec.engine import KvCacheConfig, LlmArgs, SamplingParams
from enc2dec.engine.core.request import PLACEHOLDER_TOKEN_ID
from enc2dec.engine.engine_core import EngineCore

PROMPTS = ["translate English to German: The house is wonderful.", "hello", "a b c d e f g h",
           "machine translation is fun and useful", "un chat noir dort sur le canapé"]
MAX_TOKENS = 10
NUM_STEPS = MAX_TOKENS - 1      # BART's forced BOS counts as an output token but is not sampled


def _core(path, overlap: bool) -> EngineCore:
    return EngineCore(LlmArgs(model=path, dtype="float32", max_batch_size=16, max_beam_width=4,
                              disable_overlap_scheduler=not overlap,
                              kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4,
                                                            max_cpu_memory_bytes=64 << 20)))


class NoRepeat:
    """Bans the previous token: it reads the real ids, so its request needs them on the host."""

    def __init__(self):
        self.seen: list[list[int]] = []

    def __call__(self, ids, logits):
        self.seen.append(list(ids))
        if ids:
            logits[ids[-1]] = -float("inf")


def _run(core, special: SamplingParams):
    """The special request and four greedy ones; returns outputs and, per request, the launches it was in."""
    launches = []
    launch = core.runner.launch

    def spy(so):
        # A placeholder input: the step was scheduled while the one before it still ran.
        launches.append({s.request_id: s.input_token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in so.seqs})
        return launch(so)

    core.runner.launch = spy
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    core.add(core.make_request(PROMPTS[0], special, request_id="special"))
    for i, p in enumerate(PROMPTS[1:]):
        core.add(core.make_request(p, greedy, request_id=f"g{i}"))
    results, num_steps = {}, 0
    while core.has_work():
        results.update((o.request_id, o) for o in core.step() if o.finished)
        num_steps += 1
        assert num_steps < 500
    steps_of = {rid: [i for i, ids in enumerate(launches) if rid in ids] for rid in results}
    if core.overlap:
        for rid, steps in steps_of.items():
            overlapped = [launches[i][rid] for i in steps[1:]]
            assert all(overlapped) if rid != "special" or not special.needs_host_tokens else not any(overlapped)
    return {rid: [(o.token_ids, o.finish_reason) for o in out.outputs] for rid, out in results.items()}, steps_of


def _check_greedy_keep_the_overlap(steps_of):
    special = steps_of["special"]
    for rid in (f"g{i}" for i in range(len(PROMPTS) - 1)):
        assert steps_of[rid] == list(range(NUM_STEPS)), rid       # one token per step, no gap
    # While the greedy requests run, the special one waits for its own tokens: every other step.
    assert [i for i in special if i < NUM_STEPS] == list(range(0, NUM_STEPS, 2))


@pytest.mark.parametrize("params", [
    dict(use_beam_search=True, best_of=3, n=2),
    dict(use_beam_search=True, best_of=2, n=1, logits_processors=[NoRepeat()]),
], ids=["beam", "beam+processor"])
def test_beam_request_pauses_alone(bart, params):
    special = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    with_overlap, steps_of = _run(_core(bart, overlap=True), special)
    without, _ = _run(_core(bart, overlap=False), special)
    assert with_overlap == without
    assert len(with_overlap["special"]) == special.n
    _check_greedy_keep_the_overlap(steps_of)


def test_processor_reading_ids_pauses_alone_and_sees_real_tokens(bart):
    def params(proc):
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logits_processors=[proc])

    overlapped, plain = NoRepeat(), NoRepeat()
    with_overlap, steps_of = _run(_core(bart, overlap=True), params(overlapped))
    without, _ = _run(_core(bart, overlap=False), params(plain))
    assert with_overlap == without
    assert overlapped.seen == plain.seen and len(overlapped.seen) == NUM_STEPS
    assert all(-1 not in ids for ids in overlapped.seen)
    ids = with_overlap["special"][0][0]
    assert all(a != b for a, b in zip(ids[1:], ids[2:]))          # the processor's ban held
    _check_greedy_keep_the_overlap(steps_of)


def test_processor_reading_only_the_count_keeps_the_overlap(bart):
    def count_only(ids, logits):
        assert all(i == -1 for i in ids)
    count_only.needs_token_ids = False

    special = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logits_processors=[count_only])
    with_overlap, steps_of = _run(_core(bart, overlap=True), special)
    without, _ = _run(_core(bart, overlap=False), special)
    assert with_overlap == without
    assert steps_of["special"] == list(range(NUM_STEPS))


@pytest.mark.parametrize("setting, overlap, steps_to_first", [(None, False, 1), (False, True, 2)])
def test_on_the_cpu_overlap_is_off_unless_asked_and_the_first_token_comes_with_its_step(t5_relu, setting, overlap,
                                                                                        steps_to_first):
    """A CPU launch computes its step before it returns: with the overlap, every output (the first
    token too) would only be handed back by the next step, a step's latency for nothing."""
    core = EngineCore(LlmArgs(model=t5_relu, dtype="float32", disable_overlap_scheduler=setting,
                              kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, max_cpu_memory_bytes=64 << 20)))
    try:
        assert core.overlap is overlap
        core.add(core.make_request("hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                   request_id="r", streaming=True))
        for steps in range(1, 10):       # bounded: a token that never comes fails, not hangs
            if any(o.request_id == "r" and o.outputs[0].token_ids for o in core.step()):
                break
        assert steps == steps_to_first
    finally:
        core.shutdown()
