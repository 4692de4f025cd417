"""The bare-argmax path of the sampler: a batch of plain greedy rows gives the argmax, and any
row with something to edit, report or record sends the whole batch down the general path
(its masks, biases and logprobs still apply)."""
import pytest
import torch

from enc2dec.engine.runner.sampler import Sampler, SeqSamplingState, all_plain_greedy
from enc2dec.engine.sampling_params import SamplingParams

EOS = 3


def state(suppress=(), begin_suppress=(), **params) -> SeqSamplingState:
    return SeqSamplingState(SamplingParams(**params), (EOS,), (), tuple(suppress), tuple(begin_suppress))


def logits(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    out = torch.randn(rows, 16, generator=g)
    out[:, EOS] = 10.0             # EOS is every row's argmax, so a mask on it shows
    return out


def test_plain_greedy_batch_is_the_argmax():
    states = [state(temperature=0.0), state(), state(temperature=0.0, max_tokens=4)]
    assert all_plain_greedy(states)
    x = logits(3)
    out = Sampler().sample(x, states, [0, 5, 1]).output()
    assert out.token_ids == [EOS] * 3 and out.logprobs is None


@pytest.mark.parametrize("extra", [
    dict(min_tokens=2),                                    # masks EOS while fewer than 2 tokens
    dict(logit_bias={EOS: -100.0}),
    dict(suppress=(EOS,)),
    dict(begin_suppress=(EOS,)),
    dict(bad_token_ids=[EOS]),
])
def test_one_row_with_an_edit_keeps_it_for_that_row_only(extra):
    states = [state(), state(**extra), state()]
    assert not all_plain_greedy(states)
    out = Sampler().sample(logits(3), states, [0, 0, 0]).output()
    assert out.token_ids[0] == EOS and out.token_ids[2] == EOS
    assert out.token_ids[1] != EOS


def test_rows_sharing_one_suppress_list_mask_those_ids_in_every_row():
    # Every Whisper row masks the same list (the batch then masks columns, staging nothing per
    # row); a row that also bans a word, or masks nothing, sends the batch back to per-row masks.
    suppress = (EOS, 5)
    same = [state(suppress=suppress, logprobs=0) for _ in range(3)]
    assert same[0].masked_ids is same[2].masked_ids           # one object per id set
    x = logits(3)
    x[:, 5] = 9.0                                              # the runner-up, masked too
    out = Sampler().sample(x, same, [1, 1, 1]).output()
    expected = x.clone()
    expected[:, list(suppress)] = float("-inf")
    assert out.token_ids == expected.argmax(-1).tolist() and EOS not in out.token_ids and 5 not in out.token_ids
    assert out.logprobs == pytest.approx(expected.log_softmax(-1).max(-1).values.tolist())
    mixed = [state(suppress=suppress, logprobs=0), state(suppress=suppress, bad_token_ids=[7], logprobs=0),
             state(logprobs=0)]
    x[:, 7] = 8.0
    out = Sampler().sample(x, mixed, [1, 1, 1]).output()
    assert out.token_ids[0] not in (EOS, 5) and out.token_ids[1] not in (EOS, 5, 7) and out.token_ids[2] == EOS
    assert out.token_ids[0] == 7


def test_logprobs_and_sampling_rows_are_not_plain():
    assert not state(logprobs=0).plain_greedy
    assert not state(temperature=0.8, seed=1).plain_greedy
    assert not state(repetition_penalty=1.2).plain_greedy
    assert not state(prefix_logprob_token_ids=[1], prefix_logprob_position=0).plain_greedy
    assert state(min_tokens=2, ignore_eos=True).plain_greedy     # ignore_eos: the EOS mask never applies
    out = Sampler().sample(logits(2), [state(), state(logprobs=0)], [1, 1]).output()
    assert out.token_ids == [EOS, EOS] and out.logprobs is not None and out.logprobs[0] < 0.0


def test_a_tensor_parallel_workers_rows_take_the_general_path():
    assert not all_plain_greedy([state(), None])


@pytest.mark.parametrize("case", ["ties", "nan", "all_masked", "view"])
def test_greedy_choice_is_torch_argmax(case):
    # greedy() takes max's indices for speed; it must pick what argmax picks: the first of tied
    # ids (Whisper's masks leave many -inf), a NaN's index, 0 for a row masked whole.
    from enc2dec.engine.runner.sampler import greedy

    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, (5, 51864), generator=g).float()
    if case == "nan":
        x[1, [7, 90, 40000]] = float("nan")
    elif case == "all_masked":
        x[2] = float("-inf")
        x[3, :100] = float("-inf")
        x[3, 100:] = -1e30
    elif case == "view":
        x = x[:, 3:-2]                         # a non-contiguous, odd-width view
    assert torch.equal(greedy(x), x.argmax(dim=-1))
