"""What each eval task reads, generates and measures.

Scores are on a 0-100 scale (BLEU, chrF, ROUGE); rates are fractions (WER, CER, parity),
so ``--max-wer 0.08`` means 8 %. Each threshold option checks one figure of the engine's
outputs; an option that does not apply to the task is a usage error.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DefaultDataset:
    """The dataset a task reads when ``--data`` is not given (needs the hub and ``datasets``)."""

    path: str
    config: str | None
    split: str
    source_field: str
    target_field: str

    def describe(self) -> str:
        config = f", config {self.config}" if self.config else ""
        return f"{self.path}{config}, split {self.split}"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    is_audio: bool
    whisper_task: str | None           # "transcribe" / "translate" for the audio tasks
    metrics: tuple[str, ...]           # figure names, in display order
    lower_is_better: frozenset[str]
    source_field: str                  # field defaults for local files
    target_field: str
    max_tokens: int
    # threshold option -> the figure it checks ("parity" is the exact-match rate of token ids)
    thresholds: dict[str, str] = field(default_factory=dict)
    default_data: DefaultDataset | None = None
    summary_prefix_key: str | None = None   # T5 task_specific_params key holding a source prefix


_TEXT_MAX_TOKENS = 128
# Whisper's own default sample length (n_text_ctx // 2); a 30 s window rarely needs more.
_WHISPER_MAX_TOKENS = 224

TASKS: dict[str, TaskSpec] = {
    "translation": TaskSpec(
        "translation", False, None, ("bleu", "chrf"), frozenset(), "source", "target", _TEXT_MAX_TOKENS,
        {"min_parity": "parity", "min_bleu": "bleu"},
        DefaultDataset("wmt16", "de-en", "test", "translation.de", "translation.en")),
    "summarization": TaskSpec(
        "summarization", False, None, ("rouge1", "rouge2", "rougeL", "rougeLsum"), frozenset(),
        "source", "target", _TEXT_MAX_TOKENS,
        {"min_parity": "parity", "min_rouge": "rouge1"},
        DefaultDataset("cnn_dailymail", "3.0.0", "test", "article", "highlights"),
        summary_prefix_key="summarization"),
    "transcription": TaskSpec(
        "transcription", True, "transcribe", ("wer", "cer"), frozenset({"wer", "cer"}), "audio", "text",
        _WHISPER_MAX_TOKENS, {"min_parity": "parity", "max_wer": "wer"},
        DefaultDataset("openslr/librispeech_asr", "clean", "test", "audio", "text")),
    # No default: the public speech-translation sets (CoVoST 2) need a manual download.
    "speech-translation": TaskSpec(
        "speech-translation", True, "translate", ("bleu", "chrf"), frozenset(), "audio", "text",
        _WHISPER_MAX_TOKENS, {"min_parity": "parity", "min_bleu": "bleu"}),
}

THRESHOLD_FLAGS = {"min_parity": "--min-parity", "min_bleu": "--min-bleu", "max_wer": "--max-wer",
                   "min_rouge": "--min-rouge"}

METRIC_LABELS = {"bleu": "BLEU", "chrf": "chrF", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L",
                 "rougeLsum": "ROUGE-Lsum", "wer": "WER", "cer": "CER", "parity": "exact match (token ids)"}


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        from .errors import EvalInputError

        raise EvalInputError(f"--task {name!r} is not valid; valid: {', '.join(TASKS)}")
    return TASKS[name]


def whisper_prompt(task: TaskSpec, language: str | None) -> str:
    """The decoder prefix for the engine: empty means the checkpoint's default (English
    transcription without timestamps); otherwise the language and task tokens verbatim."""
    if language is None:
        return ""
    return f"<|startoftranscript|><|{language}|><|{task.whisper_task}|><|notimestamps|>"
