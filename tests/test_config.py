"""Config validation: a user's mistake names the option and what would be valid."""
import subprocess
import sys
import textwrap

import pytest

from enc2dec.engine import KvCacheConfig, LlmArgs, SamplingParams, TuningConfig
from enc2dec.engine.config import TUNING_ENV


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
    ({"disable_overlap_scheduler": "no"}, r"disable_overlap_scheduler must be true, false or null"),
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


@pytest.mark.parametrize("data, pattern", [
    ({"scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"}},
     "capacity_scheduler_policy='MAX_UTILIZATION' is not supported.*valid: GUARANTEED_NO_EVICT"),
    ({"scheduler_config": {"use_python_scheduler": False}}, "use_python_scheduler=False is not supported"),
    ({"backend": "_autodeploy"}, "backend='_autodeploy' is not supported; valid: pytorch"),
    ({"tuning": {"attn_min_keys_per_split": 0}}, "tuning.attn_min_keys_per_split must be an integer >= 1"),
    ({"tuning": {"tp_timeout_s": -1}}, "tuning.tp_timeout_s must be a number of seconds > 0"),
    ({"tuning": {"encoder_tokens_while_decoding": -1}}, "tuning.encoder_tokens_while_decoding must be an integer >= 0"),
    ({"tuning": {"encoder_tokens_per_decoding_row": 1.5}},
     "tuning.encoder_tokens_per_decoding_row must be an integer >= 0"),
    ({"tuning": {"fused_gemv": "no"}}, "tuning.fused_gemv must be true or false"),
    ({"tuning": {"tile_gemm_configs": 1}}, "tuning.tile_gemm_configs must be a file path"),
    ({"tuning": {"encoder_beside_decoder": 1}}, "tuning.encoder_beside_decoder must be true or false"),
    ({"tuning": {"encoder_join_steps": -1}}, "tuning.encoder_join_steps must be an integer >= 0"),
    ({"tuning": {"fused_gemm": False}}, "unknown tuning key 'fused_gemm'.*'fused_gemv'"),
    ({"trust_remote_code": "yes"}, "trust_remote_code must be true or false"),
])
def test_options_that_cannot_be_honoured_are_rejected(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        LlmArgs.from_dict(data)


def test_tuning_from_yaml_and_env_overrides_land_in_the_args(tmp_path, monkeypatch):
    import dataclasses

    path = tmp_path / "c.yaml"
    path.write_text("tuning:\n  fused_gemv: false\n  attn_min_keys_per_split: 256\n")
    for var in TUNING_ENV.values():
        monkeypatch.delenv(var, raising=False)
    args = LlmArgs.from_yaml(str(path))
    assert args.tuning == TuningConfig(fused_gemv=False, attn_min_keys_per_split=256)
    monkeypatch.setenv("ENC2DEC_SKINNY_GEMM", "0")
    monkeypatch.setenv("ENC2DEC_TP_TIMEOUT_S", "30")
    tuning = dataclasses.asdict(LlmArgs.from_yaml(str(path)))["tuning"]     # what reports record
    monkeypatch.setenv("ENC2DEC_ENCODER_TOKENS_WHILE_DECODING", "3000")
    monkeypatch.setenv("ENC2DEC_ENCODER_BESIDE_DECODER", "0")
    monkeypatch.setenv("ENC2DEC_ENCODER_JOIN_STEPS", "4")
    monkeypatch.setenv("ENC2DEC_ENCODER_TOKENS_PER_DECODING_ROW", "32")
    monkeypatch.setenv("ENC2DEC_CPU_GREEDY_HEAD", "0")
    monkeypatch.setenv("ENC2DEC_CROSS_KV_HEAD_MAJOR", "0")
    monkeypatch.setenv("ENC2DEC_ENCODER_BATCHES_FIT_GRAPHS", "0")
    monkeypatch.setenv("ENC2DEC_ATTN_LAST_SPLIT_MERGES", "0")
    monkeypatch.setenv("ENC2DEC_ATTN_STORE_IN_KERNEL", "0")
    monkeypatch.setenv("ENC2DEC_PROGRAMMATIC_LAUNCH", "0")
    monkeypatch.setenv("ENC2DEC_TILE_GEMM", "1")
    monkeypatch.setenv("ENC2DEC_TILE_GEMM_CONFIGS", "/etc/enc2dec/h100.json")
    monkeypatch.setenv("ENC2DEC_TILE_GEMM_NORMS", "1")
    tuning = dataclasses.asdict(LlmArgs.from_yaml(str(path)))["tuning"]     # what reports record
    assert tuning == {"skinny_gemm": False, "fused_gemv": False, "attn_min_keys_per_split": 256,
                      "tp_timeout_s": 30.0, "encoder_tokens_while_decoding": 3000, "encoder_tokens_per_decoding_row": 32,
                      "encoder_beside_decoder": False,
                      "encoder_join_steps": 4, "encoder_batches_fit_graphs": False, "cross_kv_head_major": False,
                      "cpu_greedy_head": False, "attn_last_split_merges": False, "attn_store_in_kernel": False,
                      "programmatic_launch": False, "tile_gemm": True, "tile_gemm_configs": "/etc/enc2dec/h100.json",
                      "tile_gemm_norms": True}
    monkeypatch.setenv("ENC2DEC_FUSED_GEMV", "off")
    with pytest.raises(ValueError, match=r"ENC2DEC_FUSED_GEMV='off' \(tuning.fused_gemv\) is not valid"):
        LlmArgs()
    monkeypatch.setenv("ENC2DEC_FUSED_GEMV", "0")
    monkeypatch.setenv("ENC2DEC_ENCODER_BESIDE_DECODER", "true")
    with pytest.raises(ValueError, match=r"ENC2DEC_ENCODER_BESIDE_DECODER='true' \(tuning.encoder_beside_decoder\) "
                                         r"is not valid; expected 0 or 1"):
        LlmArgs()


def test_mixed_steps_replay_decoder_graphs_only_when_enabled():
    from types import SimpleNamespace

    from enc2dec.engine.runner.model_runner import ModelRunner

    class Graphs:
        def can_run(self, seqs):
            return True

    mixed = SimpleNamespace(encodes=["new request"], seqs=["running seq"])
    decode_only = SimpleNamespace(encodes=[], seqs=["running seq"])
    for enabled in (True, False):
        runner = SimpleNamespace(graphs=Graphs(), args=LlmArgs(enable_encoder_decoder_mixed_cuda_graph=enabled))
        assert ModelRunner._can_replay(runner, mixed) is enabled
        assert ModelRunner._can_replay(runner, decode_only) is True


def _custom_config_folder(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "configuration_custom.py").write_text(textwrap.dedent("""\
        from transformers import T5Config


        class CustomT5Config(T5Config):
            pass
        """))
    (folder / "config.json").write_text(
        '{"model_type": "t5", "d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2, "d_kv": 16,'
        ' "vocab_size": 64, "decoder_start_token_id": 0, "auto_map": {"AutoConfig": "configuration_custom.CustomT5Config"}}')
    return str(folder)


def test_trust_remote_code_lets_transformers_run_the_checkpoint_config_code(tmp_path):
    from enc2dec.engine.inputs.model_source import resolve_model

    folder = _custom_config_folder(tmp_path)
    assert type(resolve_model(folder, trust_remote_code=True).hf_config).__name__ == "CustomT5Config"
    assert type(resolve_model(folder).hf_config).__name__ == "T5Config"


def test_bench_report_records_the_tuning_in_effect(tmp_path, monkeypatch):
    import json

    from enc2dec.cli.main import app
    from transformers import T5Config
    from typer.testing import CliRunner

    model = tmp_path / "tiny_t5"
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=128, decoder_start_token_id=0,
             eos_token_id=1, pad_token_id=0).save_pretrained(model)
    config, out = tmp_path / "c.yaml", tmp_path / "r.json"
    config.write_text("tuning: {attn_min_keys_per_split: 64}\n")
    for var in TUNING_ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ENC2DEC_FUSED_GEMV", "0")
    r = CliRunner().invoke(app, ["bench", "--quiet", "--load-format", "dummy", "--model", str(model),
                                 "--config", str(config), "--concurrency", "1", "--num-requests", "1",
                                 "--input-len", "4", "--output-len", "2", "--report-json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["engine_args"]["tuning"] == {
        "skinny_gemm": True, "fused_gemv": False, "attn_min_keys_per_split": 64, "tp_timeout_s": 600.0,
        "encoder_tokens_while_decoding": 0, "encoder_tokens_per_decoding_row": 0, "encoder_beside_decoder": True,
        "encoder_join_steps": 0, "encoder_batches_fit_graphs": True, "cross_kv_head_major": True, "cpu_greedy_head": True,
        "attn_last_split_merges": True, "attn_store_in_kernel": True, "programmatic_launch": True,
        "tile_gemm": False, "tile_gemm_configs": "", "tile_gemm_norms": False}
