"""The code samples of TensorRT-LLM's encoder-decoder guide (shared/reference), with only the
import line changed and local checkpoint folders in place of hub ids."""
import numpy as np
from transformers import AutoTokenizer

from enc2dec.engine import (LLM, CudaGraphConfig, EncodeCudaGraphConfig, KvCacheConfig, SamplingParams,
                            SchedulerConfig)


def test_basic_generation_token_ids_and_batch(flan_t5):
    model = flan_t5
    with LLM(
        model=model,
        backend="pytorch",
        max_batch_size=4,
        max_input_len=512,
        max_num_tokens=2048,
        max_seq_len=512,
        kv_cache_config=KvCacheConfig(
            enable_block_reuse=False,
            free_gpu_memory_fraction=0.8,
            cross_kv_cache_fraction=0.5,
            use_kv_cache_manager_v2=False,
        ),
        scheduler_config=SchedulerConfig(use_python_scheduler=True),
    ) as llm:
        sampling_params = SamplingParams(max_tokens=64, temperature=0.0)
        result = llm.generate("translate English to German: The house is wonderful.",
                              sampling_params=sampling_params, use_tqdm=False)
        assert isinstance(result.outputs[0].text, str) and result.outputs[0].token_ids

        tokenizer = AutoTokenizer.from_pretrained(model)
        source_text = "translate English to German: The house is wonderful."
        source_token_ids = tokenizer.encode(source_text, add_special_tokens=True)
        by_ids = llm.generate(source_token_ids, sampling_params=sampling_params)
        assert by_ids.outputs[0].token_ids == result.outputs[0].token_ids

        sources = [
            "translate English to German: The house is wonderful.",
            "translate English to German: The book is on the table.",
        ]
        results = llm.generate(sources, sampling_params=sampling_params, use_tqdm=False)
        assert len(results) == 2 and results[0].outputs[0].token_ids == result.outputs[0].token_ids


def test_mbart_tokenizer_passed_in(mbart):
    tokenizer = AutoTokenizer.from_pretrained(mbart, src_lang="ro_RO")
    with LLM(model=mbart, tokenizer=tokenizer, backend="pytorch", attn_backend="TRTLLM", dtype="bfloat16",
             enable_chunked_prefill=False, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        result = llm.generate("Şeful ONU spune că nu există o soluţie militară în Siria.",
                              sampling_params=SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    ro = tokenizer.convert_tokens_to_ids("ro_RO")
    assert ro in result.prompt_token_ids                 # the source-language token from the tokenizer
    assert len(result.outputs[0].token_ids) >= 1


def test_whisper_clip_through_multi_modal_data(whisper):
    wave, sample_rate = (np.random.RandomState(0).randn(16000 * 4) * 0.1).astype(np.float32), 16000
    with LLM(
        model=whisper,
        backend="pytorch",
        attn_backend="TRTLLM",
        max_batch_size=4,
        max_input_len=1500,
        max_num_tokens=3000,
        enable_chunked_prefill=False,
        kv_cache_config=KvCacheConfig(enable_block_reuse=False, free_gpu_memory_fraction=0.8,
                                      cross_kv_cache_fraction=0.5),
        scheduler_config=SchedulerConfig(use_python_scheduler=True),
    ) as llm:
        result = llm.generate({"prompt": "", "multi_modal_data": {"audio": [(wave, sample_rate)]}},
                              sampling_params=SamplingParams(max_tokens=96, temperature=0.0), use_tqdm=False)
        prompt = "<|startoftranscript|><|fr|><|transcribe|><|notimestamps|>"
        other = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [(wave, sample_rate)]}},
                             sampling_params=SamplingParams(max_tokens=96, temperature=0.0))
    assert result.outputs[0].finish_reason in ("stop", "length")
    assert other.outputs[0].finish_reason in ("stop", "length")


def test_graph_and_overlap_options_are_accepted(flan_t5):
    with LLM(
        model=flan_t5,
        backend="pytorch",
        attn_backend="TRTLLM",
        max_batch_size=8,
        encoder_max_batch_size=2,
        encoder_max_num_tokens=2048,
        cuda_graph_config=CudaGraphConfig(max_batch_size=8, enable_padding=True),
        encoder_cuda_graph_config=EncodeCudaGraphConfig(batch_sizes=[1, 2], num_tokens=[128, 256, 512, 1024, 2048],
                                                        seq_lens=[128, 256, 512, 1024], enable_padding=True),
        enable_encoder_decoder_mixed_cuda_graph=True,
        disable_overlap_scheduler=False,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.8, cross_kv_cache_fraction=0.5),
    ) as llm:
        outs = llm.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert all(o.finished for o in outs)
