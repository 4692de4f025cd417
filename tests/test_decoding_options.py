"""The decoding options' rules on hand-made values (decoding.py), the engine's decoder prompts
that start with <|startofprev|>, and prefix log-probabilities on the tiny random Whisper."""
from __future__ import annotations

import math

import numpy as np
import pytest
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.whisper.decoding import (MAX_PROMPT_TOKENS, DecodeOptions, WindowStats, avg_logprob,
                                             best_sample, compression_ratio, is_no_speech, kept_tokens,
                                             needs_fallback, next_previous_ids, prompt_tokens, temperatures)

O = DecodeOptions(temperatures=(0.0, 0.2))


def test_fallback_fires_on_repetitive_or_unlikely_text_but_not_on_silence():
    assert compression_ratio("go forward ten meters " * 10) > 2.4 > compression_ratio("he was not an ill disposed man")
    assert needs_fallback(WindowStats(compression_ratio=3.0, avg_logprob=-0.2), O)
    assert needs_fallback(WindowStats(compression_ratio=1.2, avg_logprob=-1.5), O)
    assert not needs_fallback(WindowStats(compression_ratio=1.2, avg_logprob=-0.2), O)
    silence = WindowStats(compression_ratio=1.0, avg_logprob=-1.5, no_speech_prob=0.9)
    assert is_no_speech(silence, O) and not needs_fallback(silence, O)
    # Likely text is kept whatever the no-speech probability; thresholds of None are off.
    assert not is_no_speech(WindowStats(avg_logprob=-0.2, no_speech_prob=0.9), O)
    off = DecodeOptions(compression_ratio_threshold=None, logprob_threshold=None, no_speech_threshold=None)
    assert not needs_fallback(WindowStats(compression_ratio=9.0, avg_logprob=-9.0), off)
    assert not is_no_speech(WindowStats(no_speech_prob=1.0, avg_logprob=-9.0), off)


def test_mean_logprob_and_best_sample_follow_the_original():
    assert avg_logprob([-1.0, -2.0, -3.0], 2) == pytest.approx(-2.0)      # 2 tokens + the end token
    assert best_sample([([1, 2, 3, 4], -4.0), ([1], -2.0), ([1, 2], -1.5)]) == 2   # per token: -1, -2, -0.75


def test_prompts_hold_hotwords_then_the_latest_text_within_half_the_context():
    assert prompt_tokens(7, [], []) == []
    assert prompt_tokens(7, [1, 2], [3, 4]) == [7, 1, 2, 3, 4]
    long = list(range(100, 500))
    p = prompt_tokens(7, [1, 2], long)
    assert p[0] == 7 and p[1:3] == [1, 2] and p[-1] == long[-1] and len(p) == 1 + MAX_PROMPT_TOKENS
    assert next_previous_ids([1], [2, 3], WindowStats(temperature=0.4)) == [1, 2, 3]
    assert next_previous_ids([1], [2, 3], WindowStats(temperature=0.6)) == []     # reset after a hot window
    assert next_previous_ids(long, [1], WindowStats()) == (long + [1])[-MAX_PROMPT_TOKENS:]


def test_kept_tokens_end_at_the_last_closed_segment():
    eot, ts = 50, 100          # ids >= 100 are timestamps
    out = [100, 1, 2, 105, 105, 3, 4, 110, 110, 5, eot]
    assert kept_tokens(out, eot, ts, consumed_all=False) == [100, 1, 2, 105, 105, 3, 4, 110]
    assert kept_tokens(out, eot, ts, consumed_all=True) == out[:-1]


@pytest.mark.parametrize("kw, needle", [
    ({"temperatures": ()}, "temperature must be"), ({"temperatures": (0.0, -1.0)}, "temperature must be"),
    ({"temperatures": (math.nan,)}, "temperature must be"), ({"compression_ratio_threshold": "2"}, "finite number"),
    ({"no_speech_threshold": 1.5}, "probability in [0, 1]"), ({"best_of": 0}, "best_of must be"),
    ({"initial_prompt": 3}, "initial_prompt must be a string"),
])
def test_bad_options_name_themselves(kw, needle):
    with pytest.raises(ValueError, match=None) as e:
        DecodeOptions(**kw)
    assert needle in str(e.value)


def test_temperatures_take_a_number_or_a_list():
    assert temperatures(0) == (0.0,) and temperatures([0, 0.5]) == (0, 0.5)


@pytest.fixture(scope="module")
def tiny_llm(whisper):
    with LLM(whisper, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        yield llm


def _clip():
    return (np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1, 16000)


def _hf_logprobs(path, clip, decoder_ids, token_ids):
    """transformers' log-probabilities of ``token_ids`` after the last of ``decoder_ids``."""
    import torch
    from hf_reference import hf_whisper
    from transformers import WhisperFeatureExtractor

    model = hf_whisper(path).eval()
    features = WhisperFeatureExtractor.from_pretrained(path)(clip[0], sampling_rate=clip[1],
                                                             return_tensors="pt").input_features
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([decoder_ids])).logits[0, -1]
    return logits.float().log_softmax(-1)[token_ids].tolist()


def test_startofprev_prompts_are_hidden_and_prefix_logprobs_equal_transformers(whisper, tiny_llm):
    tok = tiny_llm.tokenizer
    prev = tok.convert_tokens_to_ids("<|startofprev|>")
    base = list(tiny_llm.engine.processor.whisper_default_prefix)
    prompt = [prev, *tok.encode(" hello there", add_special_tokens=False)]
    probe = [0, 5, base[0]]
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, prefix_logprob_token_ids=probe)
    # Position 0 (<|startoftranscript|>) of the plain prefix, and right after it in the prompted
    # one: both inner tokens of a prefix the CPU reads in one step; the last one is the step's row.
    cases = [(base, 0), (prompt + base, len(prompt) + 1), (base, len(base) - 1)]
    outs = [tiny_llm.generate({"prompt_token_ids": p, "multi_modal_data": {"audio": [_clip()]}},
                              SamplingParams(**params, prefix_logprob_position=at)).outputs[0] for p, at in cases]
    assert all(len(o.token_ids) == 4 for o in outs)                    # the prompt is no output
    for (p, at), out in zip(cases, outs):
        want = _hf_logprobs(whisper, _clip(), p[:at + 1], probe)
        assert [out.prefix_logprobs[t] for t in probe] == pytest.approx(want, abs=1e-4)


def test_bad_prefix_logprob_requests_fail_alone(tiny_llm):
    clip = {"prompt_token_ids": list(tiny_llm.engine.processor.whisper_default_prefix),
            "multi_modal_data": {"audio": [_clip()]}}
    with pytest.raises(ValueError, match="not inside the decoder prefix"):
        tiny_llm.generate(clip, SamplingParams(prefix_logprob_token_ids=[1], prefix_logprob_position=99))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate(clip, SamplingParams(prefix_logprob_token_ids=[10 ** 9]))
    with pytest.raises(ValueError, match="prefix_logprob_token_ids must be"):
        SamplingParams(prefix_logprob_token_ids=[])
    with pytest.raises(ValueError, match="must begin with <|startoftranscript|>"):
        tiny_llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"audio": [_clip()]}}, SamplingParams())


def test_the_servers_temperature_is_where_the_fallback_starts():
    from enc2dec.serve.audio import fallback_temperatures

    assert fallback_temperatures(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert fallback_temperatures(0.5) == (0.5, 0.7, 0.9)
    assert fallback_temperatures(1.0) == (1.0,)
