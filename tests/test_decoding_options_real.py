"""The original Whisper's decoding options with the real tiny.en checkpoint on LibriVox speech:
temperature fallback on a window made to repeat, an initial prompt that changes the spelling
of a name (as it does in faster-whisper), no_speech_prob against transformers' on silence and
speech, and the CLI options with their usage errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from enc2dec.cli.main import app
from enc2dec.engine.whisper.decoding import compression_ratio
from enc2dec.engine.whisper.transcribe import transcribe
from typer.testing import CliRunner

pytestmark = pytest.mark.real
NAME_CLIP = "sense_and_sensibility_01_austen_64kb-0870.wav"    # "and mister john dashwood had then leisure ..."
# faster-whisper 1.2.1 (ct2 tiny.en, float32, greedy, without timestamps) spells the name
# "Dashwood" unprompted and "Dashwode" with this initial prompt.
SPELLING_PROMPT = "John Dashwode."


def _wave(real, name):
    wave, rate = sf.read(str(real.manifest.parent / name), dtype="float32")
    assert rate == 16000
    return wave


def test_fallback_fires_on_a_repeating_window_and_keeps_the_retried_text(real_whisper, real_tiny_llm):
    # "go forward ten meters" eight times in 22 s: greedy decoding loops on it past the audio.
    repeated = (np.tile(_wave(real_whisper, "goforward.wav"), 8), 16000)
    (greedy,) = transcribe(real_tiny_llm, [repeated], temperature=0.0)
    assert greedy.num_windows == 1 and compression_ratio(greedy.text) > 2.4
    (fallback,) = transcribe(real_tiny_llm, [repeated], temperature=(0.0, 1.0), best_of=2)
    (hot,) = transcribe(real_tiny_llm, [repeated], temperature=1.0, best_of=2)     # the retry alone, same seed
    assert fallback.num_windows == 2                       # the retry was one more engine request
    assert fallback.text == hot.text and fallback.text != greedy.text


def test_a_fallback_retry_decodes_from_the_first_attempts_encoder_output(real_whisper, real_tiny_llm, monkeypatch):
    repeated = (np.tile(_wave(real_whisper, "goforward.wav"), 8), 16000)
    model, cache = real_tiny_llm.engine.runner.model, real_tiny_llm.engine.scheduler.encoder_cache
    encoded = []            # windows each encoder pass ran
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda inputs, meta: encoded.append(len(meta.seq_lens)) or encode(inputs, meta))
    (reused,) = transcribe(real_tiny_llm, [repeated], temperature=(0.0, 1.0), best_of=2)
    assert reused.num_windows == 2 and sum(encoded) == 1        # two attempts, one encoder pass
    encoded.clear()
    monkeypatch.setattr(cache, "max_entries", 0)                # nothing kept: every attempt encodes
    (encoded_twice,) = transcribe(real_tiny_llm, [repeated], temperature=(0.0, 1.0), best_of=2)
    assert encoded_twice.num_windows == 2 and sum(encoded) == 2
    assert reused.text == encoded_twice.text


def test_an_initial_prompt_changes_the_spelling_of_a_name(real_whisper, real_tiny_llm):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    plain, prompted = transcribe(real_tiny_llm, [clip]), transcribe(real_tiny_llm, [clip], initial_prompt=SPELLING_PROMPT)
    assert "Dashwood" in plain[0].text and "Dashwode" not in plain[0].text
    assert "Dashwode" in prompted[0].text and "Dashwood" not in prompted[0].text
    # The prompt is hidden decoder context, never output.
    assert not prompted[0].text.startswith(SPELLING_PROMPT)


def _hf_no_speech(real, wave, decoder_ids):
    """transformers' probability of <|nocaptions|> after the last of ``decoder_ids``."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    proc = WhisperProcessor.from_pretrained(str(real.tiny_en))
    model = WhisperForConditionalGeneration.from_pretrained(str(real.tiny_en)).eval()
    features = proc(wave, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([decoder_ids])).logits[0, -1]
    return logits.float().softmax(-1)[proc.tokenizer.convert_tokens_to_ids("<|nocaptions|>")].item()


def test_no_speech_prob_is_high_on_silence_low_on_speech_and_equals_transformers(real_whisper, real_tiny_llm):
    speech = _wave(real_whisper, NAME_CLIP)
    silence = np.zeros(5 * 16000, np.float32)
    quiet, spoken, prompted = transcribe(real_tiny_llm, [(silence, 16000), (speech, 16000), (speech, 16000)][:2],
                                         timestamps=True, strategy="sequential") + \
        transcribe(real_tiny_llm, [(speech, 16000)], timestamps=True, strategy="sequential",
                   initial_prompt=SPELLING_PROMPT)
    assert all(s.no_speech_prob > 0.9 for s in quiet.segments)
    assert spoken.segments and all(s.no_speech_prob < 0.1 for s in spoken.segments)
    assert all(s.avg_logprob < 0 and s.compression_ratio > 0 for s in spoken.segments)
    tok = real_tiny_llm.tokenizer
    sot, prev = tok.convert_tokens_to_ids("<|startoftranscript|>"), tok.convert_tokens_to_ids("<|startofprev|>")
    # [SOT] alone is the step's last token; after a prompt it is an inner one of the prefill.
    assert spoken.segments[0].no_speech_prob == pytest.approx(_hf_no_speech(real_whisper, speech, [sot]), abs=1e-3)
    prompt_ids = [prev, *tok.encode(" " + SPELLING_PROMPT, add_special_tokens=False), sot]
    assert prompted.segments[0].no_speech_prob == pytest.approx(
        _hf_no_speech(real_whisper, speech, prompt_ids), abs=1e-3)


def test_the_no_speech_rule_skips_silence_and_keeps_speech(real_whisper, real_tiny_llm):
    speech = (_wave(real_whisper, NAME_CLIP), 16000)
    silence = (np.zeros(5 * 16000, np.float32), 16000)
    # Silence decodes to a fairly confident "you": the original rule skips a window only when its
    # text is also unlikely; at a log-prob threshold of 0 every window is, so no_speech_prob decides.
    kept = transcribe(real_tiny_llm, [silence], no_speech_threshold=None)
    quiet, spoken = transcribe(real_tiny_llm, [silence, speech], logprob_threshold=0.0)
    assert kept[0].text and quiet.text == "" and quiet.error is None
    assert "Dashwood" in spoken.text


def test_library_refuses_options_it_cannot_honour(real_whisper, real_tiny_llm):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    with pytest.raises(ValueError, match="condition_on_previous_text needs strategy 'sequential'"):
        transcribe(real_tiny_llm, [clip], condition_on_previous_text=True)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        transcribe(real_tiny_llm, [clip], temperature=(0.0, -0.5))


def _cli(*args):
    return CliRunner().invoke(app, ["transcribe", *args])


def test_cli_decoding_options_reach_the_transcript(real_whisper, tmp_path):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    r = _cli(clip, "--model", str(real_whisper.tiny_en), "--strategy", "sequential", "--temperature", "0,0.5",
             "--initial-prompt", SPELLING_PROMPT, "--condition-on-previous-text", "--no-speech-threshold", "0.6",
             "-f", "json", "-o", str(tmp_path), "--quiet")
    assert r.exit_code == 0, r.output
    out = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "Dashwode" in out["text"]
    assert out["segments"] and all(0 < s["no_speech_prob"] < 0.1 and s["avg_logprob"] < 0 and s["temperature"] == 0
                                   for s in out["segments"])


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "0,hot"], "--temperature must be a number"),
    (["--temperature", "-0.2"], "--temperature must be a number >= 0"),
    (["--compression-ratio-threshold", "many"], "--compression-ratio-threshold must be a number or none"),
    (["--no-speech-threshold", "1.5"], "--no-speech-threshold is a probability in [0, 1]"),
    (["--logprob-threshold", "nan"], "--logprob-threshold must be a finite number"),
    (["--best-of", "0"], "--best-of must be an integer >= 1"),
    (["--condition-on-previous-text"], "--condition-on-previous-text needs --strategy sequential"),
])
def test_cli_bad_decoding_options_are_usage_errors(real_whisper, args, needle):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    r = _cli(clip, "--model", str(real_whisper.tiny_en), *args)
    assert r.exit_code == 2 and needle in r.stderr, r.output


def test_condition_on_previous_text_carries_the_prompt_into_the_next_window(real_whisper, real_tiny_llm):
    # 36 s of other speech, then the name: the name is heard in the second sequential window.
    names = ["0880", "0890", "0920", "0930", "0880", "0890", "0920"]
    gap = np.zeros(8000, np.float32)
    parts = [np.concatenate([_wave(real_whisper, f"sense_and_sensibility_01_austen_64kb-{n}.wav"), gap])
             for n in names]
    wave = (np.concatenate(parts + [_wave(real_whisper, NAME_CLIP)]), 16000)
    alone, carried = (transcribe(real_tiny_llm, [wave], strategy="sequential", initial_prompt=SPELLING_PROMPT,
                                 condition_on_previous_text=on)[0] for on in (False, True))
    assert alone.num_windows == carried.num_windows == 2
    # Without conditioning only the first window sees the initial prompt.
    assert "Dashwood" in alone.text and "Dashwode" in carried.text


def test_a_prefix_starts_the_transcript_with_and_without_timestamps(real_whisper, real_tiny_llm):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    prefix = "And Mister John"          # the audio says "and mister john"; unprompted tiny.en writes "Mr."
    (plain,) = transcribe(real_tiny_llm, [clip])
    (flat,) = transcribe(real_tiny_llm, [clip], prefix=prefix)
    (timed,) = transcribe(real_tiny_llm, [clip], prefix=prefix, timestamps=True, strategy="sequential")
    assert "Mr. John" in plain.text and flat.text.startswith(prefix + " Dashwood")
    # With timestamps the prefix opens the first segment at 0.0 and decoding continues it.
    assert timed.text == flat.text and timed.segments[0].start_s == 0.0
    assert timed.segments[0].text.startswith(prefix + " Dashwood") and len(timed.segments) >= 2


def test_hotwords_prompt_like_an_initial_prompt_unless_a_prefix_is_given(real_whisper, real_tiny_llm):
    clip = str(real_whisper.manifest.parent / NAME_CLIP)
    (hot,) = transcribe(real_tiny_llm, [clip], hotwords=SPELLING_PROMPT)
    (prompted,) = transcribe(real_tiny_llm, [clip], initial_prompt=SPELLING_PROMPT)
    assert hot.text == prompted.text and "Dashwode" in hot.text      # the same <|startofprev|> prompt
    # faster-whisper's rule: with a prefix the hotwords are left out.
    (prefixed,) = transcribe(real_tiny_llm, [clip], prefix="And Mister John")
    (both,) = transcribe(real_tiny_llm, [clip], prefix="And Mister John", hotwords=SPELLING_PROMPT)
    assert both.text == prefixed.text and "Dashwood" in both.text
