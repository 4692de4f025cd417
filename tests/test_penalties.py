"""Repetition / presence / frequency penalties, logit bias and bad token ids: against
transformers where it has the rule, against a row-by-row reference over host-side ids where
it does not, and through the OpenAI-shaped server fields."""

import pytest
import torch
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.runner.sampler import Sampler, SeqSamplingState
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

PROMPTS = ["translate English to German: The house is wonderful.", "a b c d e f g h", "hello"]


def _llm(path):
    return LLM(path, dtype="float32", max_batch_size=8,
               kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5, max_cpu_memory_bytes=64 << 20))


@pytest.mark.parametrize("family", ["t5_relu", "bart"])
def test_repetition_penalty_matches_transformers_greedy(family, request):
    path = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    with _llm(path) as llm:
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        for penalty in (1.8, 0.7):
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                        repetition_penalty=penalty), use_tqdm=False)
            for prompt, out in zip(PROMPTS, outs):
                ref = hf.generate(**tok(prompt, return_tensors="pt"), do_sample=False, num_beams=1,
                                  max_new_tokens=16, repetition_penalty=penalty, min_new_tokens=0,
                                  no_repeat_ngram_size=0, forced_eos_token_id=None)[0].tolist()
                start = 1                                       # the decoder start token
                got = out.outputs[0].token_ids
                assert got == ref[start:start + len(got)], (penalty, prompt)
    # the tiny models repeat themselves, so the penalty did change what they say
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain))


def _reference(row: torch.Tensor, ids: list[int], p: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for t in set(ids):
        row[t] -= p.presence_penalty + p.frequency_penalty * ids.count(t)
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    return row


def test_presence_frequency_and_bias_follow_the_openai_rule_step_by_step():
    vocab = 40
    params = [SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=0.6),
              SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.4, logit_bias={3: 2.5}),
              SamplingParams(max_tokens=30, temperature=0.0, logit_bias={5: -1.0, 6: 1.0}),
              SamplingParams(max_tokens=30, temperature=0.0)]
    states = [SeqSamplingState(p, (1,), ()) for p in params]
    host = [[] for _ in params]
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(vocab, generator=gen) * 2          # the same preferences every step: repeats tempt
    for step in range(20):
        logits = base + 0.3 * torch.randn(len(params), vocab, generator=gen)
        logits[:, 1] = float("-inf")
        out = sampler.sample(logits, states, [len(h) for h in host], seq_ids=[100, 101, 102, 103]).output()
        for i, p in enumerate(params):
            assert out.token_ids[i] == int(_reference(logits[i], host[i], p).argmax()), (step, i)
            host[i].append(out.token_ids[i])
    assert len(set(host[1])) > len(set(host[3]))          # the frequency penalty spreads the choices


def test_bad_token_ids_and_logit_bias_in_the_engine(t5_relu):
    with _llm(t5_relu) as llm:
        plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        favourite = plain.outputs[0].token_ids[0]
        banned = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         bad_token_ids=[favourite]))
        assert favourite not in banned.outputs[0].token_ids
        forced = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                         logit_bias={42: 100.0}))
        assert forced.outputs[0].token_ids == [42] * 5
        vocab = llm.engine.processor.vocab_size
        for bad in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(bad_token_ids=[-1])):
            with pytest.raises(ValueError, match="outside the vocabulary"):
                llm.generate(PROMPTS[0], bad)


def test_penalty_values_are_checked_when_the_params_are_built():
    for kw, needle in ((dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                       (dict(presence_penalty=float("nan")), "presence_penalty must be a finite"),
                       (dict(logit_bias={"7": 1.0}), "logit_bias must map"),
                       (dict(bad_token_ids=[True]), "bad_token_ids must be")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)


def test_server_fields_reach_the_sampling_params():
    pytest.importorskip("pydantic")
    from enc2dec.serve.protocol import CompletionRequest

    params = CompletionRequest(prompt="x", presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                               logit_bias={"7": 3.0}, bad_token_ids=[9]).sampling_params()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.logit_bias,
            params.bad_token_ids) == (0.5, -0.25, 1.2, {7: 3.0}, [9])
    with pytest.raises(Exception, match="integers as strings"):
        CompletionRequest(prompt=[3, 4], logit_bias={"seven": 1.0}).check_against_model(100)
