"""enc2dec bench's Whisper options (--timestamps, --timestamps-every, --detect-language) and the
decoder rows it asks for at high concurrency: what each request is sent, what the report
records, and the combinations refused with exit code 2."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from enc2dec.cli.main import app
from enc2dec.engine.inputs.known_configs import get_known_config, get_known_generation_config
from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules
from enc2dec.engine.whisper.tokens import IdOnlyTokenizer, WhisperTokens, decoding_rules
from fake_engine import FakeHandle, FakeLLM
from typer.testing import CliRunner

MODEL = "openai/whisper-large-v3"
BASE = ["bench", "--quiet", "--model", MODEL, "--load-format", "dummy", "--audio-seconds", "1",
        "--concurrency", "2", "--num-requests", "8", "--warmup", "0", "--output-len", "3"]


def _tokens() -> WhisperTokens:
    return WhisperTokens.from_generation_config(get_known_generation_config(MODEL), get_known_config(MODEL).vocab_size)


class WhisperFakeLLM(FakeLLM):
    """The fake engine shaped as a Whisper checkpoint, keeping each request's prompt and params."""

    def __init__(self, args):
        super().__init__(args, model_type="whisper")
        tokens = _tokens()
        self.tokenizer = IdOnlyTokenizer(tokens)
        self.engine.hf_config = SimpleNamespace(model_type="whisper", vocab_size=tokens.vocab_size,
                                                max_target_positions=448)
        self.engine.processor = SimpleNamespace(gen=get_known_generation_config(MODEL),
                                                feature_extractor=SimpleNamespace(sampling_rate=16000))
        self.sent = []

    def generate_async(self, prompt, params, streaming=False):
        self.sent.append((prompt["prompt"], params))
        return FakeHandle(self, [1], params, streaming)


@pytest.fixture
def whisper_llm(monkeypatch):
    made = []
    monkeypatch.setattr("enc2dec.bench.runner.start_llm", lambda args: made.append(WhisperFakeLLM(args)) or made[-1])
    return made


def _kinds(processors) -> list[type]:
    return [type(p) for p in processors or []]


def test_timestamps_every_n_sends_the_timestamp_prompt_and_rules_to_every_nth_request(whisper_llm, tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    r = CliRunner().invoke(app, [*BASE, "--timestamps-every", "4", "--report-json", str(out), "--csv", str(table)])
    assert r.exit_code == 0, r.output
    sent = whisper_llm[0].sent
    assert len(sent) == 8
    stamped = [i for i, (_, p) in enumerate(sent) if p.logits_processors]
    assert stamped == [0, 4]
    for i, (prompt, params) in enumerate(sent):
        if i in stamped:
            assert prompt == "<|startoftranscript|><|en|><|transcribe|>"       # no <|notimestamps|>
            assert _kinds(params.logits_processors) == [TimestampRules]
        else:
            assert prompt == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
        assert params.ignore_eos and params.max_tokens == 3
    rep = json.loads(out.read_text())
    assert rep["workload"]["whisper"] == {"timestamps_every": 4, "detect_language": False, "num_timestamped": 2}
    (level,) = rep["levels"]
    groups = level["groups"]
    assert groups["plain"]["completed"] == 6 and groups["timestamps"]["completed"] == 2
    assert groups["plain"]["output_tokens"] + groups["timestamps"]["output_tokens"] == level["output_tokens"]
    assert level["plain_out_tok_per_s"] == pytest.approx(groups["plain"]["output_tokens"] / level["duration_s"])
    assert "by request kind" in r.output
    assert "plain_out_tok_per_s" in table.read_text().splitlines()[0]


def test_detect_language_starts_from_startoftranscript_alone(whisper_llm, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, [*BASE, "--detect-language", "--timestamps", "--report-json", str(out)])
    assert r.exit_code == 0, r.output
    for prompt, params in whisper_llm[0].sent:
        assert prompt == "<|startoftranscript|>"
        assert _kinds(params.logits_processors) == [DetectLanguage, SuppressAtBegin, TimestampRules]
        detect = params.logits_processors[0]
        assert len(detect.language_ids) == 100 and detect.forced == [_tokens().tasks["transcribe"]]
    level = json.loads(out.read_text())["levels"][0]
    assert level["groups"] is None and level["plain_out_tok_per_s"] is None     # one kind only


def test_bench_rules_are_the_ones_transcribe_builds(whisper_llm):
    from enc2dec.engine.whisper.transcribe import MAX_INITIAL_TIMESTAMP_INDEX, TranscribeProgress, _Run

    llm = WhisperFakeLLM(None)
    run = _Run(llm, None, "transcribe", "chunked", False, 4, TranscribeProgress())
    for detect in (False, True):
        for ts in (False, True):
            ours, begin = decoding_rules(run.tokens, detect_language=detect, timestamps=ts,
                                         max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX)
            theirs, their_begin = run._processors(detect, ts, True)
            assert begin == their_begin
            assert [(type(p), vars(p)) for p in ours] == [(type(p), vars(p)) for p in theirs]


def test_high_concurrency_gets_a_decoder_row_per_request_unless_sized_explicitly(whisper_llm):
    base = [*BASE[:BASE.index("--concurrency")], "--num-requests", "4", "--warmup", "0", "--output-len", "2"]
    r = CliRunner().invoke(app, [*base, "--concurrency", "256"])
    assert r.exit_code == 0, r.output
    assert whisper_llm[-1].args.max_batch_size == 256
    r = CliRunner().invoke(app, [*base, "--concurrency", "256", "--max-batch-size", "64"])
    assert r.exit_code == 0, r.output
    assert whisper_llm[-1].args.max_batch_size == 64
    r = CliRunner().invoke(app, [*base, "--concurrency", "8"])
    assert r.exit_code == 0, r.output
    assert whisper_llm[-1].args.max_batch_size == 128          # the engine's default, not lowered


@pytest.mark.parametrize("extra, message", [
    (["--timestamps-every", "0"], "--timestamps-every"),
    (["--timestamps", "--baseline", "hf"], "--baseline"),
    (["--detect-language", "--url", "http://127.0.0.1:9"], "--url"),
])
def test_bad_whisper_options_exit_2_naming_the_option(whisper_llm, extra, message):
    r = CliRunner().invoke(app, [*BASE, *extra])
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_whisper_options_on_a_text_model_exit_2(monkeypatch):
    monkeypatch.setattr("enc2dec.bench.runner.start_llm", lambda args: FakeLLM(args))
    r = CliRunner().invoke(app, ["bench", "--quiet", "--model", "google/flan-t5-small", "--load-format", "dummy",
                                 "--concurrency", "1", "--num-requests", "1", "--warmup", "0", "--timestamps"])
    assert r.exit_code == 2, r.output
    assert "need a Whisper model" in r.output
