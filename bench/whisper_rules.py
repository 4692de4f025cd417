"""Whisper decoding options of a bench run: the timestamp prompt, language detection, and a
mixed workload in which only every N-th request decodes with timestamps.

The prompt and the logits processors are built as ``enc2dec transcribe`` builds them
(``WhisperTokens.prefix`` and ``decoding_rules``), so a bench request with these options costs
the engine what a transcribe window costs. Forced tokens (the detected language's task,
``<|notimestamps|>``) are output tokens here: every request still produces exactly its length.
"""
from __future__ import annotations

import dataclasses

from .errors import BenchInputError
from .workloads import BenchRequest

PLAIN = "plain"
TASK = "transcribe"


def request_kind(timestamps: bool, detect_language: bool) -> str:
    """The label a request's records carry, so a mixed level reports each kind apart."""
    parts = ["detect-language"] * detect_language + ["timestamps"] * timestamps
    return "+".join(parts) or PLAIN


def is_timestamped(index: int, timestamps_every: int | None) -> bool:
    """Request ``index`` of the workload decodes with timestamps: every N-th one, the first included."""
    return timestamps_every is not None and index % timestamps_every == 0


def describe(timestamps_every: int | None, detect_language: bool, num_requests: int) -> dict:
    return {"timestamps_every": timestamps_every, "detect_language": detect_language,
            "num_timestamped": sum(is_timestamped(i, timestamps_every) for i in range(num_requests))}


def apply_rules(reqs: list[BenchRequest], llm, timestamps_every: int | None,
                detect_language: bool) -> list[BenchRequest]:
    """``reqs`` with the prompt and logits processors the options ask for (unchanged when none)."""
    if timestamps_every is None and not detect_language:
        return reqs
    from enc2dec.engine.whisper.tokens import MAX_INITIAL_TIMESTAMP_INDEX, decoding_rules, engine_whisper_info

    try:
        tokens, _, _ = engine_whisper_info(llm)
    except ValueError as e:
        raise BenchInputError(f"--timestamps / --detect-language: {e}") from None
    if timestamps_every is not None and not tokens.has_timestamps:
        raise BenchInputError("--timestamps: this checkpoint's vocabulary has no timestamp tokens")
    if detect_language and not (tokens.is_multilingual and tokens.languages):
        raise BenchInputError("--detect-language needs a multilingual checkpoint whose generation config "
                              "has lang_to_id")
    if llm.tokenizer is None:
        raise BenchInputError("--timestamps / --detect-language need a tokenizer to encode the decoder prompt")
    language = None if detect_language else tokens.language_code("en")
    by_kind: dict[bool, tuple[str, list, str]] = {}
    for ts in (False, True):
        prefix = tokens.prefix(language, TASK, ts)
        processors, _ = decoding_rules(tokens, detect_language=detect_language, timestamps=ts, task=TASK,
                                       max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX)
        text = "".join(llm.tokenizer.convert_ids_to_tokens(prefix))
        by_kind[ts] = (text, processors, request_kind(ts, detect_language))
    out = []
    for i, r in enumerate(reqs):
        text, processors, kind = by_kind[is_timestamped(i, timestamps_every)]
        sampling = {**r.sampling, "logits_processors": processors} if processors else r.sampling
        out.append(dataclasses.replace(r, prompt={**r.prompt, "prompt": text}, sampling=sampling, kind=kind))
    return out
