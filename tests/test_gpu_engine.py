"""GPU path (triton attention, CUDA graphs) against transformers. Run on a GPU with `pytest -m gpu`."""
import pytest
import torch
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from hf_reference import hf_whisper
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [f"translate English to German: sentence number {i} " + "word " * (i % 7) for i in range(20)]
KV = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2)


def _reference(path, dtype, family, max_new_tokens, prompts=PROMPTS):
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=dtype).cuda().eval()
    extra = {"use_cache": False} if family == "flan_t5" else {}
    refs = []
    for p in prompts:
        enc = tok(p, return_tensors="pt").to("cuda")
        out = hf.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                          no_repeat_ngram_size=0, forced_eos_token_id=None, **extra)
        refs.append(out[0, 1:].tolist())
    return refs


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "byt5", "bart", "mbart"])
def test_float32_greedy_identical_to_transformers(family, request):
    path = request.getfixturevalue(family)
    refs = _reference(path, torch.float32, family, 16)
    with LLM(path, dtype="float32", attn_backend="triton", max_batch_size=16, kv_cache_config=KV) as llm:
        assert llm.engine.runner.backend.name == "triton"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


# The bf16 closeness test's prompts: enough that its rule is not a coin toss (below).
BF16_PROMPTS = [f"translate English to German: sentence number {i} " + "word " * (i % 7) for i in range(160)]


@pytest.mark.parametrize("family", ["t5_relu", "flan_t5", "bart", "mbart"])
def test_bfloat16_with_graphs_as_close_to_float32_as_transformers_bfloat16(family, request):
    """Tiny random checkpoints have near-tied logits, so bf16 rounding flips some greedy
    choices in any implementation, and which ones flips with the batch shapes a run happens to
    use: ours (bf16, graphs) must agree with the float32 reference on the first 16 tokens, and
    on the first token, about as often as transformers' own bf16 does (up to 15% of the requests
    fewer). A broken bf16 path diverges from the first tokens on most requests. The 95 % rule
    runs on real weights below.

    Both sides agree on about 75% of requests (flan_t5 on the CPU, 100 prompts: transformers
    bf16 72, ours 78), so the difference of two such counts over n requests has a spread of
    about sqrt(2 n 0.19): with 20 prompts a 3-request margin was 1.1 of it, and a correct
    engine failed about one run in seven (ours 14 of 20 against 18 on the H200). 160 prompts
    put the same 15% at 3 spreads."""
    path = request.getfixturevalue(family)
    ref32 = _reference(path, torch.float32, family, 16, BF16_PROMPTS)
    ref16 = _reference(path, torch.bfloat16, family, 16, BF16_PROMPTS)
    with LLM(path, dtype="bfloat16", max_batch_size=16, kv_cache_config=KV) as llm:
        assert llm.engine.runner.graphs is not None          # decoder steps replay CUDA graphs
        outs = [o.outputs[0].token_ids for o in
                llm.generate(BF16_PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)]
    margin = round(0.15 * len(BF16_PROMPTS))
    ours_vs_32 = sum(o[:16] == r[:16] for o, r in zip(outs, ref32))
    hf_vs_32 = sum(h[:16] == r[:16] for h, r in zip(ref16, ref32))
    assert ours_vs_32 >= hf_vs_32 - margin, f"ours {ours_vs_32}/{len(BF16_PROMPTS)} vs transformers bf16 {hf_vs_32}"
    ours_first = sum(o[:1] == r[:1] for o, r in zip(outs, ref32))
    hf_first = sum(h[:1] == r[:1] for h, r in zip(ref16, ref32))
    assert ours_first >= hf_first - margin, \
        f"first tokens: ours {ours_first}/{len(BF16_PROMPTS)} vs transformers bf16 {hf_first}"


def test_graphs_match_eager_in_bfloat16(flan_t5):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(flan_t5, dtype="bfloat16", max_batch_size=16, kv_cache_config=KV) as llm:
        graphed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(flan_t5, dtype="bfloat16", max_batch_size=16, kv_cache_config=KV, cuda_graph_config=None) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert graphed == eager


@pytest.mark.parametrize("fp8", [False, True])
def test_head_major_cross_pools_give_the_same_tokens(whisper, fp8):
    """tuning.cross_kv_head_major only moves where the cross K/V sits: bf16 graphs, the encoder
    writing through its own graphs, the same greedy tokens (FP8 pools too)."""
    import numpy as np

    from enc2dec.engine import TuningConfig

    prompts = [{"multi_modal_data": {"audio": [(np.random.default_rng(i).standard_normal(16000 * (1 + i % 3))
                                                .astype(np.float32) * 0.1, 16000)]}} for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kv = KvCacheConfig(cross_kv_cache_fraction=0.5, free_gpu_memory_fraction=0.2, dtype="fp8" if fp8 else "auto")
    tokens = []
    for head_major in (False, True):
        with LLM(whisper, dtype="bfloat16", max_batch_size=4, kv_cache_config=kv,
                 tuning=TuningConfig(cross_kv_head_major=head_major)) as llm:
            cross = llm.engine.runner.kv.cross_kv[0].k
            assert cross.is_contiguous() is not head_major
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_whisper_float32_on_gpu_with_device_log_mel_matches_transformers(whisper):

    import numpy as np
    from transformers import WhisperFeatureExtractor

    hf = hf_whisper(whisper, device="cuda")
    fe = WhisperFeatureExtractor.from_pretrained(whisper)
    waves = [(np.random.RandomState(i).randn(16000 * (3 + 9 * i)) * 0.1).astype(np.float32) for i in range(3)]
    with LLM(whisper, dtype="float32", attn_backend="triton", max_batch_size=4, kv_cache_config=KV) as llm:
        assert llm.engine.runner.log_mel is not None
        outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": [(w, 16000)]}} for w in waves],
                            SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    for wave, out in zip(waves, outs):
        feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features.cuda()
        ref = hf.generate(feats, max_new_tokens=12, language="en", task="transcribe").tolist()[0]
        assert out.outputs[0].token_ids[:len(ref)] == ref


@pytest.mark.real
def test_real_whisper_tiny_en_float32_triton_matches_transformers(real_whisper):
    """Real weights through the GPU path (triton attention, device log-mel), float32: the same
    greedy tokens as transformers on every LibriVox clip."""
    from transformers import WhisperFeatureExtractor

    rows, waves = real_whisper.clips()
    ckpt = str(real_whisper.tiny_en)
    hf = hf_whisper(ckpt, device="cuda")
    fe = WhisperFeatureExtractor.from_pretrained(ckpt)
    with LLM(ckpt, dtype="float32", attn_backend="triton", max_batch_size=8, kv_cache_config=KV) as llm:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.log_mel is not None
        outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": [(w, sr)]}} for w, sr in waves],
                            SamplingParams(max_tokens=96, temperature=0.0), use_tqdm=False)
    for (wave, sr), row, out in zip(waves, rows, outs):
        feats = fe(wave, sampling_rate=sr, return_tensors="pt").input_features.cuda()
        ref = hf.generate(feats, max_new_tokens=96).tolist()[0]
        got = out.outputs[0].token_ids
        assert got[-1] == hf.config.eos_token_id, row["audio"]       # HF strips the final EOS; we keep it
        assert got[:-1] == ref, row["audio"]


def _speech_variants(real_whisper):
    """66 inputs from the 6 LibriVox clips: each clip at gains 1, 0.5 and 2, each of those
    clean and with two seeds of faint noise, plus each clip's first and second half."""
    import numpy as np

    waves = []
    for wave, sr in real_whisper.clips()[1]:
        for gain in (1.0, 0.5, 2.0):
            for seed in range(3):
                noise = np.random.RandomState(seed).randn(len(wave)).astype(np.float32) * 1e-3 if seed else 0
                waves.append((np.clip(wave * gain + noise, -1, 1).astype(np.float32), sr))
        waves += [(wave[:len(wave) // 2], sr), (wave[len(wave) // 2:], sr)]
    return waves


@pytest.mark.real
def test_real_whisper_base_bfloat16_graphs_first_16_tokens(real_whisper):
    """Real weights in bf16 with CUDA graphs: the first 16 tokens identical to transformers'
    bf16 greedy output on at least 95 % of the inputs; where they differ, the difference is
    numerical: transformers' own bf16 and float32 outputs disagree there, or ours equals its
    float32 output. (Whisper base, not tiny.en: tiny.en has so many near-tied logits that
    transformers' bf16 matches its own float32 on only 49 of 54 such inputs, measured on CPU.)"""
    from transformers import WhisperFeatureExtractor

    waves = _speech_variants(real_whisper)
    ckpt = str(real_whisper.base)
    fe = WhisperFeatureExtractor.from_pretrained(ckpt)
    feats = [fe(w, sampling_rate=sr, return_tensors="pt").input_features.cuda() for w, sr in waves]
    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = hf_whisper(ckpt, dtype, "cuda")
        eos = hf.config.eos_token_id
        refs[dtype] = [[t for t in hf.generate(f.to(dtype), max_new_tokens=16, language="en", task="transcribe")
                        .tolist()[0] if t != eos][:16] for f in feats]
        del hf
    with LLM(ckpt, dtype="bfloat16", max_batch_size=32, kv_cache_config=KV) as llm:
        assert llm.engine.runner.graphs is not None
        outs = llm.generate([{"prompt": "", "multi_modal_data": {"audio": [w]}} for w in waves],
                            SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    ours = [[t for t in o.outputs[0].token_ids if t != eos][:16] for o in outs]
    same = sum(o == r for o, r in zip(ours, refs[torch.bfloat16]))
    assert same >= 0.95 * len(waves), f"{same}/{len(waves)} identical"
    for i, (o, r16, r32) in enumerate(zip(ours, refs[torch.bfloat16], refs[torch.float32])):
        if o != r16:
            assert r16 != r32 or o == r32, f"input {i}: ours {o} vs transformers bf16 {r16} (float32 agrees with it)"
