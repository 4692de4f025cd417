"""The CPU greedy head (engine/runner/greedy_head.py): the float32 head's argmax, found through a
bfloat16 copy of the head and proven in float32, on every kind of row a model gives it."""
import pytest
import torch
from torch import nn

from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.models.base import EncoderDecoderLM
from enc2dec.engine.runner.greedy_head import GreedyHead, greedy_head_available
from enc2dec.engine.runner.sampler import greedy

import enc2dec.engine.runner.greedy_head as greedy_head_module

needs_head = pytest.mark.skipif(not greedy_head_available(), reason="no bfloat16 product faster than float32 here")


@pytest.fixture(params=["onednn", "aten"], autouse=True)
def backend(request, monkeypatch):
    """Each test with oneDNN's prepacked product (where this CPU has its bfloat16 linear) and with
    ATen's bfloat16 product (what an AVX2-only CPU takes)."""
    if request.param == "onednn" and not greedy_head_module.onednn_bf16():
        pytest.skip("no oneDNN bfloat16 linear on this CPU")
    if request.param == "aten":
        monkeypatch.setattr(greedy_head_module, "onednn_bf16", lambda: False)
    return request.param


class Head(EncoderDecoderLM):
    """Just an LM head: ``compute_logits`` as every model has it."""

    def __init__(self, weight: torch.Tensor, tied: bool = False, scale: float = 1.0, bias: torch.Tensor | None = None):
        super().__init__()
        vocab, d = weight.shape
        self.embed_tokens = nn.Embedding(vocab, d)
        self._init_lm_head(vocab, d, tied=tied, logits_scale=scale)
        (self.embed_tokens if tied else self.lm_head).weight.data.copy_(weight)
        if bias is not None:
            self.register_buffer("final_logits_bias", bias.reshape(1, -1))


def _reference(model: Head, hidden: torch.Tensor) -> torch.Tensor:
    return greedy(model.compute_logits(hidden))


@needs_head
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("kind", ["untied", "tied_scaled", "bias"])
def test_ids_are_the_float32_heads_argmax(rows, kind):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(3001, 96, generator=g) * 0.05
    bias = torch.randn(3001, generator=g) * 0.5 if kind == "bias" else None
    model = Head(weight, tied=kind == "tied_scaled", scale=96 ** -0.5 if kind == "tied_scaled" else 1.0, bias=bias)
    head = GreedyHead(model)
    for _ in range(30):
        # Peaked rows (a trained model's) and flat ones (random hidden states) both.
        hidden = torch.randn(rows, 96, generator=g) * torch.rand(rows, 1, generator=g) * 20
        assert torch.equal(head(hidden), _reference(model, hidden))
    assert head.fallback_rows == 0


@needs_head
def test_a_near_tie_is_resolved_in_float32_and_an_exact_tie_by_the_lowest_id():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 64, generator=g) * 0.05
    hidden = torch.randn(2, 64, generator=g)
    # Row 0: ids 40 and 7 score the same in float32; row 1: id 300 beats id 9 by far less than
    # bfloat16 can tell, so only the float32 proof can pick it.
    weight[40] = weight[7] = hidden[0] / hidden[0].norm() * 2
    weight[9] = hidden[1] / hidden[1].norm() * 2
    weight[300] = weight[9] * (1 + 2e-5)
    model = Head(weight)
    logits = model.compute_logits(hidden)
    assert logits[0, 7] == logits[0, 40] and logits[1, 300] > logits[1, 9]
    assert torch.equal(GreedyHead(model)(hidden), _reference(model, hidden))
    assert GreedyHead(model)(hidden).tolist() == [7, 300]


@needs_head
def test_masked_ids_are_never_chosen_and_the_argmax_is_over_the_rest():
    """Whisper's rows mask a suppress list every step and more at the first one: the id is the
    float32 argmax of the masked logits, even when the mask removes each row's likeliest ids."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2500, 64, generator=g) * 0.05
    model = Head(weight)
    head = GreedyHead(model)
    for _ in range(20):
        hidden = torch.randn(4, 64, generator=g) * 10
        logits = model.compute_logits(hidden)
        # Each row loses its three likeliest ids and a shared suppress list.
        rows = [r for r in range(4) for _ in range(3)] + [r for r in range(4) for _ in range(5)]
        cols = logits.topk(3, dim=-1).indices.flatten().tolist() + [11, 222, 1333, 2000, 2499] * 4
        mask = (torch.tensor(rows), torch.tensor(cols))
        masked = logits.index_put(mask, torch.tensor(float("-inf")))
        got = head(hidden, mask)
        assert torch.equal(got, greedy(masked))
        assert all(c not in logits.topk(3, dim=-1).indices[r].tolist() for r, c in enumerate(got.tolist()))
    flat = Head(torch.ones(2000, 32))
    mask = (torch.tensor([0, 0]), torch.tensor([0, 1]))
    assert GreedyHead(flat)(torch.randn(1, 32), mask).tolist() == [2]      # the float32 head, masked too


@needs_head
def test_flat_rows_and_nan_rows_take_the_float32_head():
    weight = torch.ones(2000, 32)          # every id scores the same: all are candidates
    model = Head(weight)
    head = GreedyHead(model)
    hidden = torch.randn(1, 32)
    assert head(hidden).tolist() == [0] and head.fallback_rows == 1
    g = torch.Generator().manual_seed(1)
    model = Head(torch.randn(2000, 32, generator=g))
    head = GreedyHead(model)
    hidden = torch.randn(3, 32, generator=g)
    hidden[1, 5] = float("nan")
    assert torch.equal(head(hidden), _reference(model, hidden))
    assert head.fallback_rows >= 1


@needs_head
@pytest.mark.parametrize("family", ["flan_t5", "bart", "bart_min_tokens", "whisper"])
def test_engine_outputs_are_the_same_with_and_without_it(family, request, monkeypatch):
    """Plain greedy rows, rows with min_tokens (EOS masked while short) and Whisper's rows (a
    suppress list, begin-suppress): the same tokens either way."""
    path = request.getfixturevalue(family.removesuffix("_min_tokens"))
    if family == "whisper":
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt": "", "multi_modal_data": {"audio": [(torch.randn(16000 * (1 + i), generator=g).numpy()
                                                                 * 0.1, 16000)]}} for i in range(3)]
    else:
        prompts = [[5 + i, 9, 17, 30 + 2 * i, 11] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=family != "bart_min_tokens",
                            min_tokens=8 if family == "bart_min_tokens" else 0)
    calls = []
    real_call = GreedyHead.__call__
    monkeypatch.setattr(GreedyHead, "__call__", lambda self, h, mask=None: calls.append(mask) or real_call(self, h, mask))
    outs = {}
    for on in (True, False):
        monkeypatch.setenv("ENC2DEC_CPU_GREEDY_HEAD", "1" if on else "0")
        with LLM(model=path, max_batch_size=4, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
            assert (llm.engine.runner.greedy_head is not None) == on
            outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling_params=params, use_tqdm=False)]
    assert outs[True] == outs[False]
    assert calls                                   # every step went through it (with the head on)
    if family in ("whisper", "bart_min_tokens"):
        assert any(m is not None for m in calls)   # with the step's masks


def test_a_cpu_whose_onednn_refuses_bfloat16_takes_atens_product(backend, monkeypatch):
    """On an AVX2-only CPU oneDNN's bfloat16 reorder raises (it failed every greedy request once):
    a head told that oneDNN can, which meets the refusal, multiplies with ATen's bfloat16 product
    instead, and its ids are still the float32 head's."""
    if backend == "onednn":
        pytest.skip("the same test with the refusal made to happen: the aten run")

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(greedy_head_module, "onednn_bf16", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    g = torch.Generator().manual_seed(3)
    model = Head(torch.randn(500, 32, generator=g) * 0.05)
    head, hidden = GreedyHead(model), torch.randn(4, 32, generator=g)
    assert torch.equal(head(hidden), _reference(model, hidden)) and not head.onednn
