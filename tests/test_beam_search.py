"""Beam search against transformers' ``generate(num_beams=K)`` in float32.

Tiny random checkpoints rarely say EOS, so every search would end at the length limit;
the ``*_eos`` variants raise EOS's logit bias so hypotheses finish at many lengths and the
finished-hypothesis ranking, ``length_penalty`` and ``early_stopping`` rules all matter.
"""

import numpy as np
import pytest
import torch
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from hf_reference import hf_whisper
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationMixin,
    WhisperFeatureExtractor,
)

PROMPTS = [
    "translate English to German: The house is wonderful.",
    "hello",
    "a b c d e f g h i j k l m n o p",
    "summarize: studies have shown that owning a dog is good for you",
]
MAX_TOKENS = 14
K = 4
SETTINGS = [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)]   # (length_penalty, early_stopping)


def _llm(path, **kw):
    kw.setdefault("kv_cache_config", KvCacheConfig(cross_kv_cache_fraction=0.5, tokens_per_block=4,
                                                   max_cpu_memory_bytes=64 << 20))
    return LLM(path, dtype="float32", max_batch_size=16, max_beam_width=K, **kw)


def _beam_params(n=K, lp=1.0, es=False, max_tokens=MAX_TOKENS):
    return SamplingParams(max_tokens=max_tokens, use_beam_search=True, best_of=K, n=n, length_penalty=lp,
                          early_stopping=es)


def _score(out, lp):
    return out.cumulative_logprob / len(out.token_ids) ** lp


def _assert_same(outs, ref, lp, pad, eos, num_prefix=1):
    """Our n = K hypotheses against HF's num_return_sequences = K: same ids, order and scores.

    transformers fills the tail of a hypothesis that ended early with ``pad_token_id or
    eos_token_id``, so with pad id 0 (T5) the tail is EOS, not pad.
    """
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    fill = pad if pad else eos
    for rank, (got, (seq, score)) in enumerate(zip(outs, zip(ref.sequences.tolist(), ref.sequences_scores.tolist()))):
        expected = seq[num_prefix:num_prefix + len(got.token_ids)]
        assert got.token_ids == expected, (rank, got.token_ids, seq)
        assert all(t == fill for t in seq[num_prefix + len(got.token_ids):]), (rank, seq)   # nothing longer
        assert _score(got, lp) == pytest.approx(score, rel=1e-4, abs=1e-4), rank
    assert len(outs) == len(ref.sequences)


@pytest.fixture(scope="module")
def bart_eos(bart, tmp_path_factory):
    return _eos_heavy(bart, str(tmp_path_factory.mktemp("bart_eos")))


@pytest.fixture(scope="module")
def mbart_eos(mbart, tmp_path_factory):
    return _eos_heavy(mbart, str(tmp_path_factory.mktemp("mbart_eos")), bias=2.5)


def _eos_heavy(path: str, folder: str, bias: float = 1.5) -> str:
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] += bias
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "mbart", "bart_eos", "mbart_eos"])
def test_text_families_match_transformers_beam_search(family, request):
    path = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers 5.x crashes on T5 with num_decoder_layers != num_layers unless caching is off.
    extra = {"use_cache": False} if family == "flan_t5" else {}
    finish_reasons = set()
    with _llm(path) as llm:
        for lp, es in SETTINGS:
            all_n = llm.generate(PROMPTS, _beam_params(K, lp, es), use_tqdm=False)
            best = llm.generate(PROMPTS, _beam_params(1, lp, es), use_tqdm=False)
            for prompt, out, one in zip(PROMPTS, all_n, best):
                ref = hf.generate(**tok(prompt, return_tensors="pt"), do_sample=False, num_beams=K,
                                  num_return_sequences=K, max_new_tokens=MAX_TOKENS, length_penalty=lp,
                                  early_stopping=es, min_new_tokens=0, no_repeat_ngram_size=0,
                                  repetition_penalty=1.0, forced_eos_token_id=None,
                                  return_dict_in_generate=True, output_scores=True, **extra)
                _assert_same(out.outputs, ref, lp, tok.pad_token_id, hf.generation_config.eos_token_id)
                assert [o.index for o in out.outputs] == list(range(K))
                assert len(one.outputs) == 1 and one.outputs[0].token_ids == out.outputs[0].token_ids
                assert one.outputs[0].cumulative_logprob == out.outputs[0].cumulative_logprob
                finish_reasons |= {o.finish_reason for o in out.outputs}
    if family.endswith("_eos"):
        assert finish_reasons == {"stop", "length"}     # the variant exercises both ways to finish


def test_forced_bos_is_forced_not_searched(mbart):
    from transformers import GenerationConfig

    forced = GenerationConfig.from_pretrained(mbart).forced_bos_token_id
    with _llm(mbart) as llm:
        out = llm.generate("hello world", _beam_params(K, max_tokens=6))
    assert all(o.token_ids[0] == forced for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == K        # the search branched after the BOS


def _noise(seconds, seed=0):
    return (np.random.RandomState(seed).randn(int(16000 * seconds)) * 0.1).astype(np.float32)


def _audio(wave, sr=16000):
    return {"prompt": "", "multi_modal_data": {"audio": [(wave, sr)]}}


def test_whisper_matches_transformers_beam_search(whisper):
    hf = hf_whisper(whisper)
    fe = WhisperFeatureExtractor.from_pretrained(whisper)
    g = hf.generation_config
    prefix = [g.decoder_start_token_id, g.lang_to_id["<|en|>"], g.task_to_id["transcribe"], g.no_timestamps_token_id]
    waves = [_noise(3, 0), _noise(11.5, 1), _noise(30, 2)]
    for lp, es in SETTINGS[:2]:
        with _llm(whisper) as llm:
            outs = llm.generate([_audio(w) for w in waves], _beam_params(K, lp, es, max_tokens=12), use_tqdm=False)
        for wave, out in zip(waves, outs):
            feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features
            # Whisper's own generate returns the best hypothesis K times; the plain beam search under
            # it, with the same prefix and suppress lists, gives all K.
            ref = GenerationMixin.generate(
                hf, input_features=feats, decoder_input_ids=torch.tensor([prefix]), max_new_tokens=12,
                num_beams=K, num_return_sequences=K, length_penalty=lp, early_stopping=es, do_sample=False,
                suppress_tokens=g.suppress_tokens, begin_suppress_tokens=g.begin_suppress_tokens,
                return_dict_in_generate=True, output_scores=True)
            _assert_same(out.outputs, ref, lp, g.pad_token_id, g.eos_token_id, num_prefix=len(prefix))
            best = hf.generate(feats, max_new_tokens=12, language="en", task="transcribe", num_beams=K,
                               length_penalty=lp, early_stopping=es).tolist()[0]
            assert out.outputs[0].token_ids[:len(best)] == best


@pytest.mark.real
def test_real_whisper_base_librivox_matches_transformers_beam_search(real_whisper):

    rows, waves = real_whisper.clips()
    ckpt = real_whisper.base
    hf = hf_whisper(ckpt)
    fe = WhisperFeatureExtractor.from_pretrained(ckpt)
    with _llm(str(ckpt), kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        outs = llm.generate([_audio(w, sr) for w, sr in waves], _beam_params(1, max_tokens=96), use_tqdm=False)
    for (wave, sr), row, out in zip(waves, rows, outs):
        feats = fe(wave, sampling_rate=sr, return_tensors="pt").input_features
        ref = hf.generate(feats, max_new_tokens=96, language="en", task="transcribe", num_beams=K).tolist()[0]
        got = out.outputs[0]
        # transformers' Whisper generate strips the final <|endoftext|>; our outputs keep EOS.
        assert got.finish_reason == "stop" and got.token_ids[-1] == hf.config.eos_token_id
        assert got.token_ids[:-1] == ref, row["audio"]
        assert got.text.strip() and got.cumulative_logprob < 0


class _NoImmediateRepeat:
    """Bans the previous output token (reads the ids: each beam needs its own history)."""

    def __call__(self, output_ids, row):
        if output_ids:
            row[output_ids[-1]] = float("-inf")


def test_logits_processors_see_each_beams_own_history(t5_relu):
    from transformers import LogitsProcessor, LogitsProcessorList

    class HFNoImmediateRepeat(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > 1:                  # past the decoder start token
                scores = scores.scatter(1, input_ids[:, -1:], float("-inf"))
            return scores

    tok = AutoTokenizer.from_pretrained(t5_relu)
    hf = AutoModelForSeq2SeqLM.from_pretrained(t5_relu, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=MAX_TOKENS, use_beam_search=True, best_of=K, n=K,
                            logits_processors=[_NoImmediateRepeat()])
    with _llm(t5_relu) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(**tok(prompt, return_tensors="pt"), do_sample=False, num_beams=K, num_return_sequences=K,
                          max_new_tokens=MAX_TOKENS, logits_processor=LogitsProcessorList([HFNoImmediateRepeat()]),
                          return_dict_in_generate=True, output_scores=True)
        _assert_same(out.outputs, ref, 1.0, tok.pad_token_id, hf.generation_config.eos_token_id)
        assert all(a != b for o in out.outputs for a, b in zip(o.token_ids, o.token_ids[1:]))
