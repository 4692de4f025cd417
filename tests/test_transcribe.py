"""enc2dec transcribe on the tiny random Whisper: the logits-processor hook in the engine,
language detection and text against transformers, and the command line (outputs, per-file
errors, exit codes 0 / 1 / 2)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from enc2dec.cli.main import app
from enc2dec.engine import LLM, KvCacheConfig, SamplingParams
from enc2dec.engine.whisper.transcribe import transcribe
from hf_reference import hf_whisper as reference_whisper
from transformers import (
    AutoTokenizer,
    WhisperFeatureExtractor,
)
from typer.testing import CliRunner


def _noise(seconds, seed, rate=16000):
    return (np.random.RandomState(seed).randn(int(rate * seconds)) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_llm(whisper):
    with LLM(whisper, kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_whisper(whisper):
    return reference_whisper(whisper)


class _Force:
    """Forces a token sequence and records what the engine showed it."""

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def __call__(self, output_ids, row):
        self.seen.append(list(output_ids))
        if len(output_ids) < len(self.tokens):
            row.fill_(float("-inf"))
            row[self.tokens[len(output_ids)]] = 0.0


def test_logits_processors_see_their_own_ids_and_leave_other_rows_alone(whisper_llm):
    clip = {"prompt": "", "multi_modal_data": {"audio": [(_noise(2, 0), 16000)]}}
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    alone = whisper_llm.generate(clip, plain).outputs[0].token_ids
    force = _Force([5, 6, 7, 8])
    forced, other = whisper_llm.generate([clip, clip], [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logits_processors=[force]), plain],
        use_tqdm=False)
    assert forced.outputs[0].token_ids[:4] == [5, 6, 7, 8]
    assert other.outputs[0].token_ids == alone
    got = forced.outputs[0].token_ids
    assert force.seen == [got[:i] for i in range(len(got))]


def test_requests_with_one_multi_modal_uuid_encode_their_audio_once(whisper_llm, monkeypatch):
    model = whisper_llm.engine.runner.model
    encoded = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda inputs, meta: encoded.append(len(meta.seq_lens)) or encode(inputs, meta))
    audio = {"audio": [(_noise(3, 1), 16000)]}
    keyed = {"prompt": "", "multi_modal_data": audio, "multi_modal_uuids": {"audio": ["clip-1"]}}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = whisper_llm.generate(keyed, greedy).outputs[0].token_ids
    sampled = whisper_llm.generate(keyed, SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2,
                                                         ignore_eos=True))
    again = whisper_llm.generate(keyed, greedy).outputs[0].token_ids
    assert encoded == [1], "the later requests decode from the first one's cross K/V"
    unkeyed = whisper_llm.generate({"prompt": "", "multi_modal_data": audio}, greedy).outputs[0].token_ids
    assert encoded == [1, 1]
    assert first == again == unkeyed and len(sampled.outputs) == 2
    with pytest.raises(ValueError, match="multi_modal_uuids"):
        whisper_llm.generate({**keyed, "multi_modal_uuids": {"audio": ["a", "b"]}}, greedy)


def test_transcribe_detects_the_language_and_matches_transformers(whisper, whisper_llm, hf_whisper):
    tok = AutoTokenizer.from_pretrained(whisper)
    fe = WhisperFeatureExtractor.from_pretrained(whisper)
    waves = [_noise(3, 1), _noise(12, 2)]
    for language in (None, "fr"):
        results = transcribe(whisper_llm, [(w, 16000) for w in waves], language=language)
        for wave, t in zip(waves, results):
            feats = fe(wave, sampling_rate=16000, return_tensors="pt").input_features
            expected_lang = language or {v: k for k, v in hf_whisper.generation_config.lang_to_id.items()}[
                int(hf_whisper.detect_language(feats)[0])].strip("<|>")
            ref = hf_whisper.generate(feats, language=expected_lang, task="transcribe")
            assert t.error is None and t.language == expected_lang
            assert t.text == tok.batch_decode(ref, skip_special_tokens=True)[0].strip()
            assert t.segments == [] and t.duration_s == pytest.approx(len(wave) / 16000)


def test_library_errors(whisper_llm):
    with pytest.raises(ValueError, match="strategy 'fast' is not valid; valid: vad, chunked, sequential"):
        transcribe(whisper_llm, [], strategy="fast")
    with pytest.raises(ValueError, match="no timestamp tokens"):
        transcribe(whisper_llm, [], timestamps=True)         # the tiny vocabulary has none
    with pytest.raises(ValueError, match="'xx' is not one this checkpoint knows"):
        transcribe(whisper_llm, [], language="xx")
    t, = transcribe(whisper_llm, [(np.zeros(0, np.float32), 16000)])
    assert "empty" in t.error


# ---- command line --------------------------------------------------------------------------------
def cli(*args):
    return CliRunner().invoke(app, ["transcribe", *args])


@pytest.fixture
def audio_dir(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    sf.write(folder / "a.wav", _noise(2, 3), 16000)
    sf.write(folder / "b.flac", np.stack([_noise(40, 4, 22050)] * 2, axis=1), 22050)   # long, stereo, 22 kHz
    (folder / "c.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk")              # corrupt
    return folder


def test_cli_corrupt_file_among_good_ones(whisper, audio_dir, tmp_path):
    out = tmp_path / "out"
    # chunked: the long file is noise, where vad (the default) would rightly decode nothing.
    r = cli(str(audio_dir), "--model", whisper, "--language", "en", "-f", "txt,json", "-o", str(out),
            "--strategy", "chunked")
    assert r.exit_code == 1, r.output
    assert "error: cannot read" in r.stderr and "c.wav" in r.stderr and "Traceback" not in r.output
    assert "transcribed 2 of 3 files (1 failed)" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.txt", "b.json", "b.txt"]
    data = json.loads((out / "b.json").read_text())
    assert data["language"] == "en" and data["duration_s"] == pytest.approx(40.0) and data["text"]


def test_cli_stdout_strategies_and_quiet(whisper, audio_dir):
    for strategy in ("vad", "chunked", "sequential"):
        r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--strategy", strategy, "--quiet")
        assert r.exit_code == 0, r.output
        assert r.stdout.strip() and "==>" not in r.stdout         # one file: just its text
        assert "transcribed 1 of 1 files" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--beam-size", "0"], "--beam-size must be >= 1"),
    (["--strategy", "fast"], "--strategy 'fast' is not valid; valid: vad, chunked, sequential"),
    (["--task", "summarize"], "--task 'summarize' is not valid"),
    (["-f", "docx"], "--output-format 'docx' is not valid"),
    (["-f", "all"], "writes several files: give --output-dir"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["-f", "srt"], "no timestamp tokens"),
    (["--language", "xx"], "'xx' is not one this checkpoint knows"),
    (["--config", "/nonexistent.yaml"], "config file not found"),
])
def test_cli_usage_errors_exit_2(whisper, audio_dir, args, message):
    r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--quiet", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output


def test_cli_missing_input_and_wrong_model_family(whisper, t5_relu, audio_dir):
    r = cli(str(audio_dir / "nope.wav"), "--model", whisper)
    assert r.exit_code == 2 and "nope.wav: no such file" in r.stderr
    r = cli(str(audio_dir / "a.wav"), "--model", t5_relu, "--quiet")
    assert r.exit_code == 2 and "needs a Whisper checkpoint" in r.stderr


def test_cli_dummy_weights_without_tokenizer(tmp_path):
    """The benchmark path: a known name with random weights has no tokenizer; prefixes come
    from the generation config and the text is token ids. Sequential seeks by timestamps."""
    path = tmp_path / "long.wav"
    sf.write(path, _noise(35, 5), 16000)
    r = cli(str(path), "--model", "openai/whisper-tiny", "--load-format", "dummy", "--language", "en",
            "--strategy", "sequential", "-f", "json", "-o", str(tmp_path / "out"), "--quiet")
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "out" / "long.json").read_text())
    assert data["text"].startswith("<") and data["segments"]
    ends = [s["end"] for s in data["segments"]]
    assert ends == sorted(ends) and ends[-1] <= 35.0


def test_cli_engine_config_without_cross_fraction_gets_the_default(whisper, audio_dir, tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("max_batch_size: 4\nkv_cache_config:\n  tokens_per_block: 16\n")
    r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--config", str(config), "--quiet")
    assert r.exit_code == 0, r.output
    config.write_text("max_batch_sise: 4\n")
    r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--config", str(config), "--quiet")
    assert r.exit_code == 2 and "unknown config key 'max_batch_sise'" in r.stderr


@pytest.mark.parametrize("language", [["--language", "en"], []])    # [] detects it: beams over its rules
def test_cli_beam_size_reaches_sampling_params(whisper, audio_dir, monkeypatch, language):
    seen = []
    submit = LLM.generate_async

    def spy(self, prompt, params=None, streaming=False):
        seen.append((self.args.max_beam_width, params))
        return submit(self, prompt, params, streaming)

    monkeypatch.setattr(LLM, "generate_async", spy)
    r = cli(str(audio_dir / "a.wav"), "--model", whisper, "--beam-size", "3", "--quiet", *language)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and seen
    assert all(width == 3 and p.use_beam_search and p.best_of == 3 and p.n == 1 for width, p in seen)
