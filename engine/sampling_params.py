"""SamplingParams: how one request decodes (names follow TensorRT-LLM's LLM API)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    Greedy decoding is used when ``temperature == 0`` or when none of ``temperature``,
    ``top_k``, ``top_p`` and ``min_p`` is set (TensorRT-LLM's rule). Sampling applies, in
    transformers' order, temperature, top-k, top-p (over what top-k kept) and min-p (drop
    tokens less likely than ``min_p`` times the most likely one). A ``seed`` makes a
    request's samples reproducible, whichever requests share its batch.
    """

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    end_id: int | None = None            # overrides the checkpoint's EOS
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None          # top-k logprobs per token (0: only the sampled token's)
    # Log-probabilities of these token ids in the model's own distribution (before suppress
    # lists, rules, penalties and temperature) after decoder prefix token number
    # ``prefix_logprob_position``, returned as CompletionOutput.prefix_logprobs: computed in the
    # step that reads the prefix, one extra logits row. Whisper's no-speech probability is that
    # of <|nospeech|> right after <|startoftranscript|>.
    prefix_logprob_token_ids: list[int] | None = None
    prefix_logprob_position: int = 0
    # transformers' rule over the decoder's tokens so far (its prefix included, as transformers
    # sees decoder_input_ids): a seen token's logit is divided by it when positive and
    # multiplied by it when negative. 1.0 is off.
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted once from every token already generated, and per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None   # added to those tokens' logits (OpenAI's logit_bias)
    bad_token_ids: list[int] | None = None       # never generated (TensorRT-LLM's bad_token_ids)
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Each is called as fn(output_token_ids, logits_row) for this request's row before greedy
    # or random selection and edits logits_row ([vocab] float32) in place. Output ids exclude
    # the decoder prefix. Processors run after the suppress lists; make them picklable objects
    # (not lambdas) so requests can cross to tensor-parallel workers. Reading the ids costs a
    # device-to-host copy per step; a processor that only needs their count sets
    # ``needs_token_ids = False`` and then gets a list of -1 of the right length.
    logits_processors: Optional[list[Callable]] = None

    def __post_init__(self):
        if self.logits_processors is not None:
            self.logits_processors = list(self.logits_processors)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Every check that needs no model. The engine runs it again at submit, because the
        fields may be changed after construction; a bad value must fail its own request, never
        a step shared with others."""
        for name, lo in (("max_tokens", 1), ("n", 1), ("min_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "length_penalty", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.prefix_logprob_token_ids is not None and (
                not self.prefix_logprob_token_ids or any(isinstance(t, bool) or not isinstance(t, int)
                                                         for t in self.prefix_logprob_token_ids)):
            raise ValueError("prefix_logprob_token_ids must be a non-empty list of integer token ids")
        if isinstance(self.prefix_logprob_position, bool) or not isinstance(self.prefix_logprob_position, int) \
                or self.prefix_logprob_position < 0:
            raise ValueError(f"prefix_logprob_position must be an integer >= 0, got {self.prefix_logprob_position!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 is off), got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(k, bool) or not isinstance(k, int) or isinstance(v, bool)
                    or not isinstance(v, (int, float)) or not math.isfinite(v) for k, v in self.logit_bias.items()):
                raise ValueError("logit_bias must map token ids (integers) to finite numbers")
        if self.bad_token_ids is not None and any(isinstance(t, bool) or not isinstance(t, int)
                                                  for t in self.bad_token_ids):
            raise ValueError("bad_token_ids must be a list of integer token ids")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"n ({self.n}) must not exceed best_of ({self.best_of})")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.logits_processors is not None:
            bad = [p for p in self.logits_processors if not callable(p)]
            if bad:
                raise ValueError(f"logits_processors must be callables fn(output_token_ids, logits_row); "
                                 f"got {type(bad[0]).__name__}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        if self.use_beam_search:
            return False
        if self.temperature == 0:
            return True
        return self.temperature is None and self.top_k is None and self.top_p is None and self.min_p is None

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the tokens generated so far."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a step of this request needs its previous step's tokens on the host: beam
        search picks the surviving beams there, and a Python logits processor that reads the ids
        gets them there. Rules the sampler applies batched on the device (``batched = True``,
        e.g. Whisper's timestamp grammar) and processors that read only the count need neither,
        so such requests keep the overlap."""
        return self.use_beam_search or any(getattr(fn, "needs_token_ids", True) and not getattr(fn, "batched", False)
                                           for fn in self.logits_processors or ())

    @property
    def beam_width(self) -> int:
        return (self.best_of or self.n) if self.use_beam_search else 1
