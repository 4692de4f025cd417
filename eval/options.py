"""Everything one eval run needs, validated before any model loads."""
from __future__ import annotations

from dataclasses import dataclass, field

from .data import DataSpec
from .errors import EvalInputError
from .tasks import THRESHOLD_FLAGS, TaskSpec, get_task

REFERENCES = ("hf", "none")


@dataclass(frozen=True)
class EvalOptions:
    task: str
    model: str
    data: DataSpec = field(default_factory=lambda: DataSpec(None))
    prefix: str | None = None               # text tasks; None: the checkpoint's own, if it has one
    language: str | None = None             # Whisper: the spoken language
    max_tokens: int | None = None
    batch_size: int = 16
    num_beams: int = 1
    reference: str = "hf"
    warmup: int = 1
    # threshold option name (min_parity, ...) -> limit
    thresholds: dict[str, float] = field(default_factory=dict)
    config: str | None = None
    engine_overrides: dict = field(default_factory=dict)   # dtype, device, load_format, max_batch_size
    report_json: str | None = None
    save_outputs: str | None = None
    command: str = ""

    @property
    def spec(self) -> TaskSpec:
        return get_task(self.task)

    def validate(self) -> None:
        spec = self.spec
        if self.num_beams < 1:
            raise EvalInputError(f"--num-beams must be >= 1 (1: greedy), got {self.num_beams}")
        if self.reference not in REFERENCES:
            raise EvalInputError(f"--reference {self.reference!r} is not valid; valid: {', '.join(REFERENCES)}")
        for name, flag in (("batch_size", "--batch-size"), ("max_tokens", "--max-tokens")):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EvalInputError(f"{flag} must be >= 1, got {value}")
        if self.data.limit is not None and self.data.limit < 1:
            raise EvalInputError(f"--limit must be >= 1, got {self.data.limit}")
        if self.warmup < 0:
            raise EvalInputError(f"--warmup must be >= 0, got {self.warmup}")
        if spec.is_audio and self.prefix:
            raise EvalInputError(f"--prefix applies to text tasks; --task {self.task} reads audio "
                                 "(use --language for Whisper's language token)")
        if not spec.is_audio and self.language:
            raise EvalInputError(f"--language applies to the Whisper tasks; for --task {self.task} put the "
                                 "instruction in --prefix (e.g. 'translate English to German: ')")
        if self.task == "speech-translation" and not self.language:
            raise EvalInputError("--task speech-translation needs --language (the spoken language, e.g. de): "
                                 "the engine does not detect languages")
        for name, limit in self.thresholds.items():
            flag = THRESHOLD_FLAGS[name]
            if name not in spec.thresholds:
                valid = ", ".join(THRESHOLD_FLAGS[n] for n in spec.thresholds)
                raise EvalInputError(f"{flag} does not apply to --task {self.task}; its checks: {valid}")
            if name == "min_parity":
                if self.reference == "none":
                    raise EvalInputError("--min-parity needs --reference hf (parity is measured against "
                                         "transformers)")
                if not 0 <= limit <= 1:
                    raise EvalInputError(f"--min-parity is a fraction in [0, 1], got {limit}")
            if name == "max_wer" and limit < 0:
                raise EvalInputError(f"--max-wer is a fraction (0.08 = 8 %) and must be >= 0, got {limit}")
        if self.reference == "hf" and self.engine_overrides.get("load_format") == "dummy":
            raise EvalInputError("--reference hf compares against the checkpoint's weights, but --load-format "
                                 "dummy draws random ones; use --reference none with dummy weights")
