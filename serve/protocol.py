"""OpenAI request models (pydantic) and the response shapes built from RequestOutputs.

Unknown fields are refused (400 names them) rather than silently ignored: a client that
sends an option expects it to do something. Fields OpenAI defines but this engine cannot
honour (``echo``, ``suffix``) are accepted only at their neutral value.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, field_validator

from .errors import bad_request

TokenIds = list[StrictInt]
Prompt = Union[str, list[str], TokenIds, list[TokenIds]]
MAX_LOGPROBS = 20


Int = StrictInt
Bool = StrictBool


def _not_bool(value):
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


Float = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]


def _check_text(value, where: str):
    """Lone surrogates (JSON allows "\\ud800") are not text: they break tokenizers and encoders."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid Unicode text (an unpaired surrogate at character {e.start})") \
                from None
    elif isinstance(value, list):
        for v in value:
            _check_text(v, where)
    return value


class TextFields(BaseModel):
    """Every string field, nested or not, must be valid Unicode."""

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value, info):
        return _check_text(value, info.field_name)


class StreamOptions(TextFields):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class CompletionRequest(TextFields):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Prompt
    max_tokens: Int | None = Field(16, ge=1)
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)          # -1 or 0: off (vLLM's and TensorRT-LLM's convention)
    seed: Int | None = None
    n: Int = Field(1, ge=1, le=64)
    best_of: Int | None = Field(None, ge=1, le=64)
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    early_stopping: Union[Bool, Literal["never"]] = False
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: Bool = False
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: Bool = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: Bool = True
    stream: Bool = False
    stream_options: StreamOptions | None = None
    echo: Bool = False
    suffix: str | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(1.0, gt=0.0)
    logit_bias: dict[str, Float] | None = None
    bad_token_ids: list[StrictInt] | None = None
    user: str | None = None

    @property
    def sequences_per_prompt(self) -> int:
        """Decoder sequences one prompt occupies: its beams, or its n samples."""
        return (self.best_of or self.n) if self.use_beam_search else self.n

    def check_against_model(self, vocab_size: int | None) -> None:
        """Token ids and top_k inside the vocabulary, before anything reaches the engine."""
        if vocab_size is None:
            return
        for name, ids in (("stop_token_ids", self.stop_token_ids or ()), ("prompt", _flat_ids(self.prompt)),
                          ("bad_token_ids", self.bad_token_ids or ()), ("logit_bias", list(self._logit_bias() or ()))):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                  name)
        if self.top_k is not None and self.top_k > vocab_size:
            raise bad_request(f"top_k={self.top_k} exceeds the vocabulary size ({vocab_size}); use -1 for no "
                              "top-k limit", "top_k")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids."""
        try:
            return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None

    def prompts(self) -> list:
        """One entry per engine request: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        if any(isinstance(x, list) and not x for x in p):
            raise bad_request("prompt must not contain an empty token list", "prompt")
        return list(p)

    def sampling_params(self):
        from enc2dec.engine import SamplingParams

        for name in ("echo", "suffix"):
            if getattr(self, name):      # accepted only at the neutral value (False, None, 0, {})
                raise bad_request(f"{name} is not supported by this server; omit it", name)
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise bad_request(f"best_of={self.best_of} with n={self.n} needs use_beam_search=true (ranking "
                              "sampled candidates is not supported); omit best_of or set it equal to n", "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        try:
            return SamplingParams(
                max_tokens=self.max_tokens or 16, temperature=self.temperature, top_p=self.top_p,
                top_k=None if self.top_k in (None, -1, 0) else self.top_k, seed=self.seed, n=self.n,
                best_of=self.best_of if self.use_beam_search else None, use_beam_search=self.use_beam_search,
                length_penalty=self.length_penalty, early_stopping=self.early_stopping, stop=self.stop,
                stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                skip_special_tokens=self.skip_special_tokens, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=self._logit_bias(),
                bad_token_ids=self.bad_token_ids)
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e))) from None


def _flat_ids(prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt
    if isinstance(prompt, list):
        return [t for p in prompt if isinstance(p, list) for t in p]
    return []


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].strip("(),:")
    return word if word in CompletionRequest.model_fields else None


# ---- responses ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "stop"


class LogprobFormatter:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

    def format(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int, offset: int = 0) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lp in zip(token_ids, logprobs):
            text = self.token_text(tok)
            tokens.append(text)
            token_lps.append(lp.get(tok))
            ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:num_top] if num_top else [(tok, lp.get(tok))]
            tops.append({self.token_text(t): v for t, v in ranked})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

