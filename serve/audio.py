"""POST /v1/audio/transcriptions and /v1/audio/translations (Whisper), as OpenAI takes them.

Multipart fields: file, model, language (transcriptions only), prompt, response_format
(json | text | srt | vtt | verbose_json), temperature, stream (json and text),
timestamp_granularities[] (segment and/or word, with verbose_json: word adds OpenAI's
top-level ``words`` list), and the extensions max_tokens / ignore_eos (vLLM's; ``enc2dec
bench --url`` sends them). ``prompt`` and ``temperature`` mean OpenAI's: previous text the
decoder is prompted with (``<|startofprev|>``), and the temperature decoding starts at, 0.2
hotter per fallback.

Two paths, both through the engine's async API:
- direct: a clip of at most 30 s, no timestamps, language known (given, or an
  English-only model; English when max_tokens / ignore_eos are sent without one, as the
  engine's default prefix is), streamed, with an engine extension or a verbatim decoder
  prefix (a prompt that starts with <|startoftranscript|>): one engine request at the one
  temperature (streamed text cannot be taken back), token by token;
- long-form: anything else goes through ``enc2dec.engine.whisper.transcribe`` as
  ``enc2dec transcribe`` does: 30 s windows, timestamp rules, temperature fallback, the
  no-speech rule. Audio over 30 s follows ``--long-form-strategy``: vad by default, as for
  ``enc2dec transcribe`` (the most accurate on docs/transcribe.md's measurements; its windows
  of one upload decode together). A clip of at most 30 s is one window whatever the strategy.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Annotated, Literal

from fastapi import Form, Request, Response, UploadFile
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict, Field

from .audio_input import decode_upload
from .completions import check_model
from .errors import APIError, bad_request
from .protocol import TextFields
from .streaming import SSE_DONE, ClientGone, event_stream, failed_stream_events, sse, sse_error, unless_disconnected
from .subtitles import verbose_segments, verbose_words

WINDOW_S = 30.0
ENCODER_POSITIONS_PER_S = 50          # Whisper: 1500 encoder positions per 30 s window
TIMED_FORMATS = ("verbose_json", "srt", "vtt")
SOT = "<|startoftranscript|>"
logger = logging.getLogger("enc2dec.serve")


class TranslationForm(TextFields):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    file: UploadFile = Field(description="The audio file (WAV, FLAC, OGG, Opus or MP3)")
    model: str | None = None
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    stream: bool = False
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(None, alias="timestamp_granularities[]")
    max_tokens: int | None = Field(None, ge=1)
    ignore_eos: bool = False


class TranscriptionForm(TranslationForm):
    language: str | None = None


def register(app, front, config) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcribe(form: Annotated[TranscriptionForm, Form()], request: Request):
        return await _handle(front, config, form, request, form.language, "transcribe")

    @app.post("/v1/audio/translations")
    async def translate(form: Annotated[TranslationForm, Form()], request: Request):
        return await _handle(front, config, form, request, None, "translate")


async def _handle(front, config, form, request, language: str | None, task: str):
    from enc2dec.engine.whisper.tokens import engine_whisper_info

    check_model(config, form.model)
    if form.stream and form.response_format not in ("json", "text"):
        raise bad_request(f"stream=true needs response_format json or text, not {form.response_format}", "stream")
    front.check_accepting()
    info, llm = front.info, front.llm
    if not info.is_whisper:
        raise bad_request(f"{config.model_name} is a {info.model_type} text model: use /v1/completions", "model")
    tokens, fe, max_positions = engine_whisper_info(llm)
    try:
        tokens.check_task(task)
        lang = tokens.language_code(language) if language else (None if tokens.is_multilingual else "en")
    except ValueError as e:
        raise bad_request(str(e), "language" if language and "language" in str(e) else "model") from None
    wave = await front.run_input(decode_upload, await form.file.read(), form.file.filename, fe.sampling_rate,
                                 config.max_audio_s)
    duration_s = len(wave) / fe.sampling_rate
    timed = form.response_format in TIMED_FORMATS and tokens.has_timestamps
    raw_prefix = bool(form.prompt) and form.prompt.startswith(SOT)     # a verbatim decoder prefix
    words = "word" in (form.timestamp_granularities or ())
    if words and form.response_format != "verbose_json":
        raise bad_request("timestamp_granularities word needs response_format verbose_json, not "
                          f"{form.response_format}", "timestamp_granularities")
    if words and not tokens.has_timestamps:
        raise bad_request("this model's vocabulary has no timestamp tokens: word timestamps are not available",
                          "timestamp_granularities")
    if lang is None and (form.max_tokens or form.ignore_eos):
        lang = "en"       # the engine extensions mean one exact engine request: the engine's default language
    # One exact engine request (token-by-token streaming, the engine extensions, a raw prefix):
    # a single temperature, as a streamed text cannot be taken back for a fallback.
    exact = form.stream or form.max_tokens or form.ignore_eos or raw_prefix
    direct = duration_s <= WINDOW_S and not timed and exact and (lang is not None or raw_prefix)
    if direct:
        if raw_prefix:
            prefix = form.prompt
        elif llm.tokenizer is not None:
            prefix = _previous_text(llm.tokenizer, form.prompt) + "".join(
                llm.tokenizer.convert_ids_to_tokens(tokens.prefix(lang, task, False)))
        elif lang == "en" and task == "transcribe" and not form.prompt:
            prefix = ""          # no tokenizer (dummy weights): the engine's default prefix is this one
        else:
            raise bad_request("this model has no tokenizer (dummy weights): only English transcription "
                              "without a prompt", "model")
        room = max_positions - (len(llm.tokenizer.encode(prefix, add_special_tokens=False)) if prefix
                                else len(tokens.prefix(lang, task, False)))
        return await _direct(front, request, form, wave, fe.sampling_rate, prefix, room, lang, task, duration_s)
    if raw_prefix or form.max_tokens or form.ignore_eos:
        raise bad_request(f"max_tokens, ignore_eos and a prompt starting with {SOT} (a verbatim decoder prefix) "
                          "apply to clips of at most 30 s transcribed without timestamps (response_format json "
                          "or text)" + (" with a language given" if lang is None else ""),
                          "prompt" if raw_prefix else "max_tokens")
    return await _long_form(front, config, request, form, wave, fe.sampling_rate, lang, task, timed, duration_s,
                            words)


def _previous_text(tokenizer, prompt: str | None) -> str:
    """OpenAI's prompt as the original Whisper's: <|startofprev|> and the prompt's last tokens."""
    from enc2dec.engine.whisper.decoding import MAX_PROMPT_TOKENS

    if not prompt or not prompt.strip():
        return ""
    ids = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)[-MAX_PROMPT_TOKENS:]
    return "<|startofprev|>" + tokenizer.decode(ids)


def fallback_temperatures(start: float) -> tuple[float, ...]:
    """OpenAI's temperature: where decoding starts; a window that fails the thresholds decodes
    again 0.2 hotter, up to 1.0 (0 gives the original Whisper's 0, 0.2, ..., 1.0)."""
    steps = max(0, math.floor((1.0 - start) / 0.2 + 1e-9))
    return tuple(round(start + 0.2 * k, 6) for k in range(steps + 1)) or (start,)


# ---- direct: one engine request -------------------------------------------------------------
async def _direct(front, request, form, wave, rate, prefix, room, lang, task, duration_s):
    """``room``: decoder positions left after the prefix (the engine would cap with a warning)."""
    from enc2dec.engine import SamplingParams

    tok = front.llm.tokenizer
    if room < 1:
        raise bad_request("the decoder prefix fills the model's whole position table", "prompt")
    try:
        params = SamplingParams(max_tokens=min(form.max_tokens or room, room), temperature=form.temperature,
                                ignore_eos=form.ignore_eos)
    except ValueError as e:
        raise bad_request(str(e)) from None
    prompt = {"prompt": prefix, "multi_modal_data": {"audio": [(wave, rate)]}}
    if form.stream:
        batch = await front.submit([prompt], params, streaming=True)
        return event_stream(request, batch, _events(front, batch, duration_s))
    try:
        (out,) = await unless_disconnected(request, front.generate([prompt], params))
    except ClientGone:
        return Response(status_code=499)
    c = out.outputs[0]
    return _respond(form, task, lang, c.text.strip(), [], len(c.token_ids), duration_s, tok)


async def _events(front, batch, duration_s: float):
    """A delta event per engine step with new tokens (its text may be empty while a character is
    incomplete, or always without a tokenizer), so clients can time every token."""
    sent, num_tokens = "", 0
    async for _, out in batch.stream():
        if out.error:
            for event in failed_stream_events(front, out):
                yield event
            return
        c = out.outputs[0]
        text = c.text.lstrip()
        delta = text[len(sent):] if text.startswith(sent) else ""
        if delta or len(c.token_ids) > num_tokens:
            yield sse({"type": "transcript.text.delta", "delta": delta})
            sent, num_tokens = sent + delta, len(c.token_ids)
        if out.finished:
            front.finish(out)
            yield sse(_done_event(c.text.strip(), duration_s, len(c.token_ids)))
    if batch.cut_reason:
        yield sse_error(503, batch.cut_reason, "server_shutdown")
    yield SSE_DONE


# ---- long-form: enc2dec.engine.whisper.transcribe ---------------------------------------------------
# The server's set-up, not the client's request: a 500 that tells the operator the fix. Clips of
# at most 30 s need no VAD and still work.
_VAD_MISSING = ("--long-form-strategy vad (the default) needs silero-vad and onnxruntime for audio over 30 s: "
                'pip install "enc2dec[audio]" on the server, or start it with --long-form-strategy chunked or '
                "sequential")


async def _long_form(front, config, request, form, wave, rate, lang, task, timed, duration_s, words=False):
    from enc2dec.engine.whisper.transcribe import transcribe_async

    if config.long_form_strategy == "vad" and duration_s > WINDOW_S:
        from enc2dec.engine.whisper.vad import check_available

        try:
            check_available()
        except ValueError:
            logger.error(_VAD_MISSING)
            raise APIError(500, _VAD_MISSING, code="vad_unavailable") from None
    num_windows = max(1, math.ceil(duration_s / WINDOW_S))     # about: for the queue bound and the batch
    front.check_accepting(num_windows)
    t0 = time.monotonic()
    with front.reserve(num_windows):
        try:
            (t,) = await unless_disconnected(request, transcribe_async(
                front.llm, [(wave, rate)], language=lang, task=task, timestamps=timed, batch_size=num_windows,
                strategy=config.long_form_strategy, temperature=fallback_temperatures(form.temperature),
                initial_prompt=form.prompt or None, word_timestamps=words))
        except ClientGone:
            return Response(status_code=499)
        except ValueError as e:
            raise bad_request(str(e)) from None
    front.record_long_form(t.num_windows, t.num_tokens, time.monotonic() - t0, failed=bool(t.error))
    if t.error:
        raise APIError(500, f"transcription failed: {t.error}", code="engine_error")
    if form.stream:
        async def events():
            if t.text:
                yield sse({"type": "transcript.text.delta", "delta": t.text})
            yield sse(_done_event(t.text, duration_s, t.num_tokens))
            yield SSE_DONE
        from fastapi.responses import StreamingResponse

        return StreamingResponse(events(), media_type="text/event-stream")
    return _respond(form, task, t.language or lang or "en", t.text, t.segments, t.num_tokens, duration_s,
                    front.llm.tokenizer)


# ---- responses ------------------------------------------------------------------------------
def _respond(form, task, lang, text, segments, num_tokens, duration_s, tokenizer):
    from types import SimpleNamespace

    from enc2dec.engine.whisper.subtitles import to_srt, to_vtt
    from enc2dec.engine.whisper.transcribe import Segment
    from enc2dec.engine.whisper.tokens import language_name

    fmt = form.response_format
    if fmt == "json":
        return {"text": text, "usage": _usage(duration_s, num_tokens)}
    if fmt == "text":
        return PlainTextResponse(text)
    segments = segments or ([Segment(0.0, round(duration_s, 3), text, temperature=form.temperature)]
                            if text else [])
    if fmt == "srt":      # the same writers as enc2dec transcribe
        return PlainTextResponse(to_srt(SimpleNamespace(segments=segments)))
    if fmt == "vtt":
        return PlainTextResponse(to_vtt(SimpleNamespace(segments=segments)), media_type="text/vtt")
    out = {"task": task, "language": language_name(lang or "en").lower(), "duration": round(duration_s, 3),
           "text": text}
    granularities = form.timestamp_granularities or ["segment"]
    if "word" in granularities:
        out["words"] = verbose_words(segments)
    if "segment" in granularities:
        out["segments"] = verbose_segments(segments, tokenizer)
    return {**out, "usage": {"type": "duration", "seconds": math.ceil(duration_s)}}


def _done_event(text: str, duration_s: float, num_tokens: int) -> dict:
    return {"type": "transcript.text.done", "text": text, "usage": _usage(duration_s, num_tokens)}


def _usage(duration_s: float, output_tokens: int) -> dict:
    # Input tokens: the encoder positions the audio fills (50 a second), not the padded 1500.
    audio_tokens = math.ceil(duration_s * ENCODER_POSITIONS_PER_S)
    return {"type": "tokens", "input_tokens": audio_tokens, "output_tokens": output_tokens,
            "total_tokens": audio_tokens + output_tokens,
            "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": 0}}
