"""The dummy-weights table: every entry builds the engine's model with the checkpoint's real size.

Parameter counts are the published ones (model cards, papers), computed here from the
engine's own model class built on the meta device (no memory, no init), so a wrong width,
depth, FFN size or vocabulary in the table shows as a count off by far more than 2%.
"""
from __future__ import annotations

import pytest
import torch
from enc2dec.engine.inputs.known_configs import KNOWN_MODELS, get_known_config, get_known_generation_config
from enc2dec.engine.inputs.model_source import resolve_model
from enc2dec.engine.models import get_model_class
from enc2dec.engine.models.attention import TorchAttentionBackend
from enc2dec.engine.whisper.tokens import NUM_TIMESTAMP_TOKENS, WhisperTokens

# name -> published parameters (millions): model cards of each checkpoint; ByT5 paper, Table 1
PUBLISHED_MILLIONS = {
    "openai/whisper-large-v3-turbo": 809,
    "distil-whisper/distil-large-v3": 756,
    "openai/whisper-small": 244,
    "google/flan-t5-base": 248,
    "google-t5/t5-base": 223,
    "facebook/bart-large": 406,
    "google/byt5-small": 300,
}


@pytest.mark.parametrize("name", list(PUBLISHED_MILLIONS))
def test_entry_builds_the_engine_model_at_the_published_size(name):
    config = get_known_config(name)
    with torch.device("meta"):
        model = get_model_class(config)(config, TorchAttentionBackend())
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert millions == pytest.approx(PUBLISHED_MILLIONS[name], rel=0.02)
    assert config.name_or_path == name


def test_t5_base_is_reachable_by_its_short_hub_name():
    assert "t5-base" in KNOWN_MODELS
    source = resolve_model("t5-base", None, "dummy")
    assert source.hf_config.name_or_path == "google-t5/t5-base"
    assert source.hf_config.feed_forward_proj == "relu" and source.hf_config.d_ff == 3072


@pytest.mark.parametrize("name, decoder_layers", [("openai/whisper-large-v3-turbo", 4),
                                                  ("distil-whisper/distil-large-v3", 2)])
def test_large_v3_derivatives_keep_its_encoder_tokens_and_timestamps(name, decoder_layers):
    config, large = get_known_config(name), get_known_config("openai/whisper-large-v3")
    assert config.decoder_layers == decoder_layers and config.encoder_layers == large.encoder_layers == 32
    assert config.num_mel_bins == 128
    tokens = WhisperTokens.from_generation_config(get_known_generation_config(name), config.vocab_size)
    assert tokens.has_timestamps and tokens.timestamp_begin + NUM_TIMESTAMP_TOKENS == config.vocab_size
    assert len(tokens.languages) == 100 and tokens.languages["yue"] == 50358
    assert tokens.prefix("en", "transcribe", timestamps=False) == [50258, 50259, 50360, 50364]


def test_whisper_language_tokens_are_transformers_languages_in_id_order():
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    for name, count in (("openai/whisper-small", 99), ("openai/whisper-large-v3", 100)):
        gen = get_known_generation_config(name)
        assert list(gen.lang_to_id) == [f"<|{c}|>" for c in list(LANGUAGES)[:count]]
        assert list(gen.lang_to_id.values()) == list(range(50259, 50259 + count))
        # the task tokens follow the last language token
        assert gen.task_to_id["translate"] == 50259 + count


def test_byt5_small_runs_one_bench_request_on_cpu():
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["bench", "--quiet", "--model", "google/byt5-small", "--load-format", "dummy",
                                 "--concurrency", "1", "--num-requests", "1", "--warmup", "0",
                                 "--input-len", "8", "--output-len", "3"])
    assert r.exit_code == 0, r.output
    assert "1/0" in r.output


@pytest.mark.parametrize("name", ["facebook/bart-base", "whisper-base", "not-a-model"])
def test_the_whisper_stand_in_tokenizer_passes_over_names_outside_the_table(name):
    """bench and transcribe ask for the stand-in tokenizer before the engine resolves the model;
    a name outside the table (the alias "t5-base" has no owner) once raised IndexError there
    instead of reaching model_source's error, which lists the known names."""
    from enc2dec.engine import LlmArgs
    from enc2dec.engine.whisper.tokens import IdOnlyTokenizer, with_stand_in_tokenizer

    args = LlmArgs(model=name, load_format="dummy")
    assert with_stand_in_tokenizer(args) is args
    whisper = with_stand_in_tokenizer(LlmArgs(model="openai/whisper-base", load_format="dummy"))
    assert isinstance(whisper.tokenizer, IdOnlyTokenizer)


def test_bench_names_the_known_models_for_a_dummy_name_outside_the_table(monkeypatch):
    """The command a user ran when the lookup above raised IndexError: it exits 2 with the list
    of names that need no download (the hub is off here, as on a machine without it)."""
    from enc2dec.cli.main import app
    from typer.testing import CliRunner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(app, ["bench", "--quiet", "--model", "facebook/bart-base", "--load-format", "dummy",
                                 "--concurrency", "1", "--num-requests", "1", "--output-len", "2"])
    assert r.exit_code == 2, r.output
    assert "IndexError" not in r.output
    assert "need no download" in r.output and "facebook/bart-large" in r.output
