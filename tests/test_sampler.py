"""The sampler on CPU: sampled tokens follow the filtered distribution, seeded rows reproduce
whatever batch they share, and greedy rows stay the argmax of the filtered logits."""
import math

import numpy as np
import pytest
import torch

from enc2dec.engine.runner.sampler import Sampler, SeqSamplingState
from enc2dec.engine.runner.sampling_ops import stream_key
from enc2dec.engine.sampling_params import SamplingParams

EOS = 11
# Twelve tokens, no two alike, so no filter boundary is a tie.
LOGITS = torch.tensor([2.0, 1.7, 1.3, 1.1, 0.8, 0.5, 0.2, -0.1, -0.5, -1.0, -1.6, -2.4])
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264}
NUM_DRAWS = 20_000


def state(seed=None, index=0, eos=(EOS,), stop=(), **params) -> SeqSamplingState:
    p = SamplingParams(seed=seed, **params)
    stream = stream_key(seed, index) if seed is not None and not p.is_greedy else None
    return SeqSamplingState(p, eos, stop, stream=stream)


def expected_probs(temperature=None, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """The target distribution, computed independently in float64: top-k, top-p over the
    renormalised survivors, then min-p."""
    z = LOGITS.double().numpy() / (temperature or 1.0)
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[:top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p is not None:
        before = np.cumsum(p[order]) - p[order]
        assert np.abs(before - top_p).min() > 1e-3, "fixture too close to a top-p boundary"
        keep[order[before >= top_p]] = False
    if min_p is not None:
        assert np.abs(p - min_p * p.max()).min() > 1e-3, "fixture too close to a min-p boundary"
        keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


FILTERS = [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
           dict(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05), dict(min_p=0.2)]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("streams", ["seed per row", "one seed over positions", "unseeded"])
def test_draws_follow_the_filtered_softmax(filters, streams):
    if streams == "seed per row":
        states, positions = [state(seed=i, **filters) for i in range(NUM_DRAWS)], [3] * NUM_DRAWS
    elif streams == "one seed over positions":
        states, positions = [state(seed=42, **filters)] * NUM_DRAWS, list(range(NUM_DRAWS))
    else:
        torch.manual_seed(0)
        states, positions = [state(**filters)] * NUM_DRAWS, [0] * NUM_DRAWS
    logits = LOGITS.expand(NUM_DRAWS, -1).contiguous()
    ids = Sampler().sample(logits, states, positions).output().token_ids
    counts = np.bincount(ids, minlength=len(LOGITS))
    want = expected_probs(**filters)
    assert counts[want == 0].sum() == 0, f"filtered-out tokens drawn: {counts} for {want}"
    kept = want > 0
    expected = want[kept] * NUM_DRAWS
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL[int(kept.sum()) - 1], f"chi2={chi2:.1f}: {counts} vs {expected.round()}"


def _draws(rows_at_step, target_row: int, steps: int = 30) -> list[int]:
    """The target row's token at each of ``steps`` positions, with logits that change per step."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for pos in range(steps):
        logits = (torch.randn(1, 40, generator=gen) * 2).expand(len(rows_at_step), -1).contiguous()
        ids = Sampler().sample(logits, rows_at_step, [pos] * len(rows_at_step)).output().token_ids
        out.append(ids[target_row])
    return out


def test_seeded_row_is_the_same_on_any_row_of_any_batch():
    me = state(seed=1234, temperature=0.9, top_p=0.95)
    alone = _draws([me], 0)
    neighbours = [state(temperature=0.0), state(temperature=1.0), state(seed=7, temperature=1.0, top_k=3),
                  me, state(seed=1234, index=1, temperature=0.9, top_p=0.95), state(min_p=0.1),
                  state(seed=99, temperature=2.0)]
    assert _draws(neighbours, 3) == alone
    assert _draws(neighbours[::-1], 3) == alone
    assert _draws([me], 0) == alone                                   # and again: no hidden state
    other_seed = _draws([state(seed=1235, temperature=0.9, top_p=0.95)], 0)
    second_sample = _draws([state(seed=1234, index=1, temperature=0.9, top_p=0.95)], 0)
    assert other_seed != alone and second_sample != alone
    assert len(set(alone)) > 5                                        # really sampled, not stuck on one token


def test_greedy_rows_are_the_argmax_of_the_masked_logits_beside_sampled_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 12, generator=gen)
    logits[:, EOS] = 10.0                                             # every row would pick EOS
    states = [state(temperature=0.0), state(temperature=0.0, min_tokens=3, max_tokens=8),
              state(seed=3, temperature=1.0, min_tokens=3, max_tokens=8), state(seed=4, temperature=1.0),
              state(temperature=0.0, stop=(4,), min_tokens=3, max_tokens=8), state(top_k=2)]
    out = Sampler().sample(logits.clone(), states, [0, 1, 1, 0, 2, 5]).output().token_ids
    masked = logits.clone()
    masked[[1, 2, 4], EOS] = float("-inf")                           # min_tokens not reached yet
    masked[4, 4] = float("-inf")                                      # nor may the stop token end it early
    assert out[0] == EOS and out[1] == int(masked[1].argmax()) and out[4] == int(masked[4].argmax())
    assert out[2] != EOS and out[3] == EOS                            # sampled: min_tokens still masks EOS
    assert out[5] in logits[5].topk(2).indices.tolist()


def test_logprobs_of_sampled_and_greedy_rows_come_from_the_unscaled_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, generator=gen)
    states = [state(temperature=0.0, logprobs=2), state(seed=5, temperature=1.5, logprobs=0),
              state(temperature=0.5, top_k=4, logprobs=3)]
    out = Sampler().sample(logits, states, [0, 0, 0]).output()
    ref = logits.log_softmax(dim=-1)
    for r, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp == pytest.approx(float(ref[r, tok]), abs=1e-6)
        assert out.top_logprobs[r][tok] == lp
    assert set(out.top_logprobs[0]) == set(ref[0].topk(2).indices.tolist())
    assert len(out.top_logprobs[2]) in (3, 4)                         # the top 3, plus the drawn token


def test_seeded_noise_is_exponential_and_distinct_per_token():
    from enc2dec.engine.runner.sampling_ops import seeded_exponential

    keys = torch.tensor([[*stream_key(s, 0), p] for s in range(4) for p in range(4)])
    noise = seeded_exponential(keys, 5000)                            # [16, 5000]
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.02) and noise.std().item() == pytest.approx(1.0, abs=0.03)
    assert len(set(noise[:, 0].tolist())) == 16                       # every (seed, position) its own draw
    assert torch.equal(noise, seeded_exponential(keys, 5000))
    corr = np.corrcoef(noise[:, :-1].numpy().ravel(), noise[:, 1:].numpy().ravel())[0, 1]
    assert abs(corr) < 0.02 and not math.isnan(corr)                  # neighbouring tokens independent


@pytest.mark.parametrize("bad, message", [(dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
                                          (dict(seed=1.5), "seed"), (dict(top_k=2.5), "top_k"),
                                          (dict(temperature=float("inf")), "temperature")])
def test_bad_sampling_options_name_the_option(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_batch_where_every_row_draws_keeps_each_draw_on_its_row():
    # Seeded rows are drawn first; with no greedy row the sampler skips the argmax, so the draws
    # must be put back in the batch's order. top_k=1 rows draw their argmax, so they show where
    # each landed.
    me = state(seed=1234, temperature=0.9, top_p=0.95)
    alone = _draws([me], 0)
    batch = [state(temperature=0.7, top_k=1), me, state(temperature=1.3, top_k=1)]
    gen = torch.Generator().manual_seed(5)
    for pos in range(30):
        logits = torch.randn(3, 40, generator=gen) * 2
        ids = Sampler().sample(logits, batch, [pos] * 3).output().token_ids
        assert ids[0] == int(logits[0].argmax()) and ids[2] == int(logits[2].argmax())
    assert _draws(batch, 1) == alone


def test_one_sampler_over_steps_uses_each_steps_own_requests():
    # The sampler keeps the drawing rows' parameters while the batch holds the same requests; a
    # batch of the same size with other requests must be drawn with theirs.
    sampler, logits = Sampler(), LOGITS.expand(2000, -1).contiguous()
    greedy_like = [state(temperature=1.0, top_k=1) for _ in range(2000)]
    assert set(sampler.sample(logits, greedy_like, [0] * 2000).output().token_ids) == {0}
    assert set(sampler.sample(logits, greedy_like, [1] * 2000).output().token_ids) == {0}     # kept: same rows
    free = [state(temperature=1.0) for _ in range(2000)]
    assert len(set(sampler.sample(logits, free, [2] * 2000).output().token_ids)) > 5


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 64, 65])
def test_drawing_parameters_reach_the_kernels_16_byte_aligned_at_any_batch_size(rows):
    # The race kernels are compiled per pointer alignment: a parameter vector starting mid-line
    # at some batch size would compile a second variant (about a second's stall) in serving.
    from enc2dec.engine.runner.sampler import _DrawPlan

    states = [state(temperature=0.8, top_p=0.95, min_p=0.01 * (i % 3), top_k=i % 4) for i in range(rows)]
    plan = _DrawPlan(states, list(range(rows)), torch.device("cpu"))
    top_k, top_p, min_p, _ = plan.filters
    for t in (plan.temperature, top_k, top_p, min_p):
        assert t.is_contiguous() and t.shape == (rows,) and t.data_ptr() % 16 == 0
    assert plan.temperature.tolist() == pytest.approx([0.8] * rows)
    assert min_p.tolist() == pytest.approx([0.01 * (i % 3) for i in range(rows)])


def test_one_sampler_over_steps_keeps_seeded_rows_reproducible_as_the_batch_changes():
    # The sampler keeps a batch's draw plan between steps and stages only the output positions:
    # a seeded row stepped by one sampler, while neighbours join and leave, must draw what it
    # draws at each position from its own key (stream words, position) by the race itself.
    from enc2dec.engine.runner.sampling_ops import race

    me = state(seed=1234, temperature=0.9, top_p=0.95)
    joining = [state(temperature=1.0), state(seed=7, temperature=1.0, top_k=3), state(temperature=0.0)]
    sampler, gen, got, want = Sampler(), torch.Generator().manual_seed(5), [], []
    for pos in range(30):
        batch = joining[:pos // 8] + [me]             # the same rows for 8 steps, then one more joins
        logits = (torch.randn(1, 40, generator=gen) * 2).expand(len(batch), -1).contiguous()
        got.append(sampler.sample(logits, batch, [pos] * len(batch)).output().token_ids[-1])
        key = torch.tensor([[*me.stream, pos]])
        filters = (torch.zeros(1, dtype=torch.long), torch.tensor([0.95]), torch.zeros(1), 0)
        want.append(int(race(logits[:1] / 0.9, key, 1, filters)[0]))
    assert got == want and len(set(want)) > 5
