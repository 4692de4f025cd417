"""The LLM API against transformers.generate in float32: identical greedy token ids."""

import numpy as np
import pytest
import torch
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from hf_reference import hf_whisper
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    WhisperFeatureExtractor,
)

PROMPTS = [
    "translate English to German: The house is wonderful.",
    "summarize: the quick brown fox jumps over the lazy dog again and again while the cat sleeps",
    "hello",
    "a b c d e f g h i j k l m n o p",
]
MAX_TOKENS = 12


def _llm(path, **kw):
    kw.setdefault("kv_cache_config", KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4,
                                                   max_cpu_memory_bytes=64 << 20))
    return LLM(path, dtype="float32", max_batch_size=8, **kw)


def _hf_greedy(model, tok, prompt, max_new_tokens, **kw):
    enc = tok(prompt, return_tensors="pt")
    out = model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=0, no_repeat_ngram_size=0, repetition_penalty=1.0,
                         forced_eos_token_id=None, **kw)   # we never inject EOS at the limit (TRT-LLM rule)
    return out[0, 1:].tolist()     # drop decoder_start; keep forced BOS and EOS


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "byt5", "bart", "mbart"])
def test_text_families_match_transformers_greedy(family, request):
    path = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers 5.x crashes on T5 with num_decoder_layers != num_layers unless caching is off.
    extra = {"use_cache": False} if family == "flan_t5" else {}
    with _llm(path) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected = _hf_greedy(hf, tok, prompt, MAX_TOKENS, **extra)
        got = out.outputs[0]
        assert got.token_ids == expected, prompt
        assert got.finish_reason == ("stop" if expected[-1] == tok.eos_token_id and len(expected) < MAX_TOKENS
                                     else "length")
        assert out.prompt_token_ids == tok(prompt).input_ids


def test_forced_bos_is_returned_and_counts_against_max_tokens(mbart):
    from transformers import GenerationConfig

    forced = GenerationConfig.from_pretrained(mbart).forced_bos_token_id
    assert forced is not None
    with _llm(mbart) as llm:
        out = llm.generate("hello world", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        assert out.outputs[0].token_ids[0] == forced
        assert len(out.outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match="max_tokens=1 is too small.*forces a BOS"):
            llm.generate("hello world", SamplingParams(max_tokens=1))


def _noise(seconds, seed=0):
    return (np.random.RandomState(seed).randn(int(16000 * seconds)) * 0.1).astype(np.float32)


def test_whisper_matches_transformers_greedy(whisper):
    hf = hf_whisper(whisper)
    fe = WhisperFeatureExtractor.from_pretrained(whisper)
    waves = [_noise(3, 0), _noise(11.5, 1), _noise(30, 2)]
    with _llm(whisper) as llm:
        outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": [(w, 16000)]}} for w in waves],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    for wave, out in zip(waves, outs):
        feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features
        # Our documented default on a multilingual checkpoint: English transcription, no timestamps.
        ref = hf.generate(feats, max_new_tokens=MAX_TOKENS, language="en", task="transcribe").tolist()[0]
        assert out.outputs[0].token_ids == ref


def test_whisper_prompt_replaces_the_prefix(whisper):
    tok = AutoTokenizer.from_pretrained(whisper)
    hf = hf_whisper(whisper)
    fe = WhisperFeatureExtractor.from_pretrained(whisper)
    wave = _noise(5, 3)
    prompt = "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    prefix = tok.encode(prompt, add_special_tokens=False)
    with _llm(whisper) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [(wave, 16000)]}},
                           SamplingParams(max_tokens=6, temperature=0.0))
        with pytest.raises(ValueError, match="must begin with <\\|startoftranscript\\|>"):
            llm.generate({"prompt": "<|fr|>", "multi_modal_data": {"audio": [(wave, 16000)]}})
    feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features
    ids = torch.tensor([prefix])
    for _ in range(6):      # teacher-free greedy with HF from the same prefix
        logits = hf(input_features=feats, decoder_input_ids=ids).logits[0, -1]
        for t in hf.generation_config.suppress_tokens or []:
            logits[t] = -float("inf")
        if ids.shape[1] == len(prefix):
            for t in hf.generation_config.begin_suppress_tokens or []:
                logits[t] = -float("inf")
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert out.outputs[0].token_ids == ids[0, len(prefix):].tolist()


@pytest.mark.real
def test_real_whisper_librivox_matches_transformers(real_whisper):

    rows, waves = real_whisper.clips()
    for ckpt in (real_whisper.tiny_en, real_whisper.base):
        hf = hf_whisper(ckpt)
        fe = WhisperFeatureExtractor.from_pretrained(ckpt)
        multilingual = hf.config.vocab_size >= 51865
        with _llm(str(ckpt), kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
            outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": [(w, sr)]}} for w, sr in waves],
                                SamplingParams(max_tokens=96, temperature=0.0), use_tqdm=False)
        for (wave, sr), row, out in zip(waves, rows, outs):
            feats = fe(wave, sampling_rate=sr, return_tensors="pt").input_features
            kw = {"language": "en", "task": "transcribe"} if multilingual else {}
            ref = hf.generate(feats, max_new_tokens=96, **kw).tolist()[0]
            got = out.outputs[0].token_ids
            # transformers' Whisper generate strips the final <|endoftext|>; our outputs keep EOS.
            assert out.outputs[0].finish_reason == "stop" and got[-1] == hf.config.eos_token_id
            assert got[:-1] == ref, (ckpt.name, row["audio"])
            assert out.outputs[0].text.strip()
