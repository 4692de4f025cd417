"""The original Whisper's decoding options: temperature fallback, the no-speech rule and
decoder prompts (previous text, an initial prompt, hotwords, a forced prefix).

Token ids, floats and strings only (no torch, no engine), so each rule is unit tested on
hand-made values; ``transcribe.py`` turns them into engine requests.

- Fallback: a window decodes at the first temperature; when its text is too repetitive
  (gzip compression ratio above ``compression_ratio_threshold``) or too unlikely (mean token
  log-probability below ``logprob_threshold``), it is decoded again, as one new engine request,
  at the next temperature, and the last attempt is kept, as the original Whisper does. Beam
  search at temperature 0, ``best_of`` samples (the likeliest kept) above it.
- No speech: a window whose <|nospeech|> probability after <|startoftranscript|> exceeds
  ``no_speech_threshold`` while its text is unlikely (mean log-probability below
  ``logprob_threshold``) is skipped: no text, the seek moves past it.
- Prompts: ``<|startofprev|>`` + hotwords + the latest previous text, at most
  ``MAX_PROMPT_TOKENS`` together, before the usual prefix; ``prefix`` text is forced after the
  task tokens of a file's first window (and is part of its transcript).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PROMPT_TOKENS = 223          # the original: half the 448-position decoder context, minus <|startofprev|>
DEFAULT_FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)     # the original Whisper's --temperature
PROMPT_RESET_TEMPERATURE = 0.5   # previous text is dropped after a window decoded above it (likely garbage)


@dataclass(frozen=True)
class DecodeOptions:
    temperatures: tuple[float, ...] = (0.0,)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    best_of: int = 5
    condition_on_previous_text: bool = False
    initial_prompt: str | None = None
    hotwords: str | None = None
    prefix: str | None = None

    def __post_init__(self):
        temps = self.temperatures
        if not temps or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                            or x < 0 for x in temps):
            raise ValueError(f"temperature must be a number >= 0 or a non-empty list of them (e.g. "
                             f"0,0.2,0.4,0.6,0.8,1.0), got {temps!r}")
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number or None (off), got {value!r}")
        if self.no_speech_threshold is not None and not 0.0 <= self.no_speech_threshold <= 1.0:
            raise ValueError(f"no_speech_threshold is a probability in [0, 1], got {self.no_speech_threshold}")
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < 1:
            raise ValueError(f"best_of must be an integer >= 1, got {self.best_of!r}")
        for name in ("initial_prompt", "hotwords", "prefix"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")


def temperatures(value: float | Sequence[float]) -> tuple[float, ...]:
    """A temperature or a fallback list as a tuple (validated by ``DecodeOptions``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),)
    try:
        return tuple(value)
    except TypeError:
        return (value,)


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib stream: repeated phrases push it up."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def avg_logprob(sampled_logprobs: Sequence[float], num_text_tokens: int) -> float:
    """The original's mean: every sampled token (timestamps and the end token included) over
    the tokens before the end token, plus one."""
    return sum(sampled_logprobs) / (num_text_tokens + 1)


@dataclass(frozen=True)
class WindowStats:
    """What the decode of one window measured (the attempt that was kept)."""

    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    num_attempts: int = 1


def needs_fallback(stats: WindowStats, o: DecodeOptions) -> bool:
    too_repetitive = o.compression_ratio_threshold is not None and \
        stats.compression_ratio > o.compression_ratio_threshold
    too_unlikely = o.logprob_threshold is not None and stats.avg_logprob < o.logprob_threshold
    # Silence decodes to unlikely text; another temperature would only make up other text.
    return (too_repetitive or too_unlikely) and not is_no_speech(stats, o)


def is_no_speech(stats: WindowStats, o: DecodeOptions) -> bool:
    if o.no_speech_threshold is None or stats.no_speech_prob <= o.no_speech_threshold:
        return False
    return o.logprob_threshold is None or stats.avg_logprob < o.logprob_threshold


def best_sample(candidates: Sequence[tuple[list[int], float]]) -> int:
    """Index of the likeliest of ``best_of`` samples: (token ids, summed log-probability),
    ranked by log-probability per token as the original's ranker without a length penalty."""
    return max(range(len(candidates)), key=lambda i: candidates[i][1] / max(1, len(candidates[i][0])))


def prompt_tokens(start_of_prev: int, hotword_ids: list[int], previous_ids: list[int]) -> list[int]:
    """``<|startofprev|>`` + hotwords + the latest previous text, at most ``MAX_PROMPT_TOKENS``
    after the marker (hotwords first, then as much recent text as fits); empty with neither."""
    hot = hotword_ids[:MAX_PROMPT_TOKENS]
    room = MAX_PROMPT_TOKENS - len(hot)
    prev = previous_ids[-room:] if room > 0 else []
    return [start_of_prev, *hot, *prev] if hot or prev else []


def kept_tokens(ids: list[int], eot: int, timestamp_begin: int, consumed_all: bool) -> list[int]:
    """The part of a window's output the next window starts after, timestamps included (the
    original conditions on them, which keeps the next window emitting timestamps): through the
    last closed timestamp pair, or everything when the whole window was consumed."""
    ids = [t for t in ids if t != eot]
    if consumed_all:
        return ids
    pair_ends = [i for i in range(1, len(ids)) if ids[i] >= timestamp_begin and ids[i - 1] >= timestamp_begin]
    return ids[:pair_ends[-1]] if pair_ends else ids


def next_previous_ids(previous_ids: list[int], window_ids: list[int], stats: WindowStats) -> list[int]:
    """The text a sequential window passes on to the next: all so far, reset after a window
    decoded hot (its text is likely wrong, and conditioning on it makes the next wrong too)."""
    if stats.temperature > PROMPT_RESET_TEMPERATURE:
        return []
    return (previous_ids + window_ids)[-MAX_PROMPT_TOKENS:]
