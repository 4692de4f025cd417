"""Config validation: a user's mistake names the option and what would be valid."""
import subprocess
import sys
import textwrap

import pytest

from enc2dec.engine import KvCacheConfig, LlmArgs, SamplingParams


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ValueError, match="unknown config key 'max_bach_size'.*max_batch_size"):
        LlmArgs.from_dict({"max_bach_size": 4})


def test_unknown_nested_key():
    with pytest.raises(ValueError, match="unknown kv_cache_config key 'cross_fraction'"):
        LlmArgs.from_dict({"kv_cache_config": {"cross_fraction": 0.5}})


@pytest.mark.parametrize("data, pattern", [
    ({"kv_cache_config": {"cross_kv_cache_fraction": 1.5}}, r"cross_kv_cache_fraction must be a number in \(0, 1\)"),
    ({"dtype": "float8"}, "dtype='float8' is not valid; valid: auto, float32, float16, bfloat16"),
    ({"attn_backend": "flash"}, "attn_backend='flash' is not supported; valid: auto, torch, triton, TRTLLM, VANILLA"),
    ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
    ({"context_parallel_size": 2}, "context_parallel_size must be 1"),
    ({"enable_attention_dp": True}, "enable_attention_dp must be False"),
    ({"enable_chunked_prefill": True}, "enable_chunked_prefill must be False"),
    ({"load_format": "gguf"}, "load_format='gguf' is not valid"),
    ({"cuda_graph_config": {"batch_sizes": [0, 2]}}, "cuda_graph_config.batch_sizes must be a non-empty list"),
    ({"encoder_cuda_graph_config": {"seq_lens": [0, 64]}}, "encoder_cuda_graph_config.seq_lens must be a non-empty list"),
    ({"scheduler_config": {"capacity_scheduler_policy": "FIFO"}}, "capacity_scheduler_policy='FIFO' is not valid"),
    ({"kv_cache_config": {"use_kv_cache_manager_v2": True}, "max_beam_width": 4}, "requires max_beam_width=1"),
    ({"max_beam_width": 8, "max_batch_size": 4}, r"max_beam_width \(8\) must not exceed max_batch_size \(4\)"),
])
def test_invalid_values_name_the_key(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        LlmArgs.from_dict(data)


def test_trtllm_guide_yaml_loads_unchanged(tmp_path):
    # The serve example of the TensorRT-LLM encoder-decoder guide, verbatim.
    path = tmp_path / "enc-dec-config.yaml"
    path.write_text(textwrap.dedent("""\
        attn_backend: TRTLLM
        dtype: bfloat16
        disable_overlap_scheduler: false
        enable_chunked_prefill: false
        max_batch_size: 8
        encoder_max_batch_size: 2
        encoder_max_num_tokens: 1024
        max_beam_width: 1
        max_input_len: 512
        max_num_tokens: 2048
        max_seq_len: 512
        cuda_graph_config:
          max_batch_size: 8
          enable_padding: true
        encoder_cuda_graph_config:
          batch_sizes: [1, 2]
          num_tokens: [128, 256, 512, 1024]
          seq_lens: [128, 256, 512]
          enable_padding: true
        enable_encoder_decoder_mixed_cuda_graph: true
        kv_cache_config:
          enable_block_reuse: false
          free_gpu_memory_fraction: 0.8
          cross_kv_cache_fraction: 0.5
          use_kv_cache_manager_v2: false
        scheduler_config:
          use_python_scheduler: true
        """))
    args = LlmArgs.from_yaml(str(path), model="google/flan-t5-small")
    assert args.kv_cache_config.cross_kv_cache_fraction == 0.5
    assert args.encoder_cuda_graph_config.num_tokens == (128, 256, 512, 1024)
    assert args.cuda_graph_config.capture_sizes(args.max_batch_size)[-1] == 8
    assert args.model == "google/flan-t5-small"


def test_bad_yaml_is_a_value_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_batch_size: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        LlmArgs.from_yaml(str(path))
    with pytest.raises(ValueError, match="config file not found"):
        LlmArgs.from_yaml(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("kwargs, pattern", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"n": 4, "best_of": 2}, r"n \(4\) must not exceed best_of \(2\)"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
])
def test_sampling_params_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_greedy_rule_follows_trtllm():
    assert SamplingParams().is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(top_k=5).is_greedy


def test_kv_cache_config_rejects_block_reuse():
    with pytest.raises(ValueError, match="enable_block_reuse"):
        KvCacheConfig(enable_block_reuse=True)


def test_config_import_does_not_pull_torch():
    code = "import sys; import enc2dec.engine as e; e.LlmArgs(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
