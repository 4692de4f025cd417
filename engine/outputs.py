"""What ``LLM.generate`` returns (TensorRT-LLM / vLLM shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None    # the stop token id or stop string that matched
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    prefix_logprobs: dict[int, float] | None = None     # SamplingParams.prefix_logprob_token_ids

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.monotonic seconds) for one request."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)   # one per step that produced tokens


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
