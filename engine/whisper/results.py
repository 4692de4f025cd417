"""What a transcription returns, and the progress hooks it calls: torch-free, so the
CLI's progress bar and the subtitle writers import none of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Word(NamedTuple):
    word: str              # as decoded, with its leading space: a segment's words join to its text
    start_s: float
    end_s: float
    probability: float     # the mean probability of its tokens


class Segment(NamedTuple):
    start_s: float
    end_s: float
    text: str
    # Of the window decode the segment came from (the original Whisper's segment fields; 0.0 for
    # segments built by hand): mean token log-probability, gzip compression ratio of the window's
    # text, probability of <|nospeech|>, and the temperature of the kept decode.
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    temperature: float = 0.0
    words: tuple[Word, ...] = ()       # empty unless word timestamps were asked


@dataclass
class Transcript:
    source: str
    text: str = ""
    segments: list[Segment] = field(default_factory=list)   # empty unless timestamps were asked
    language: str | None = None
    duration_s: float = 0.0
    error: str | None = None
    num_windows: int = 0                                      # engine requests made
    num_tokens: int = 0                                       # tokens they generated


class TranscribeProgress:
    """Progress hooks (all optional); called from the event loop that runs ``transcribe``."""

    def start(self, total_audio_s: float) -> None: ...
    def advance(self, audio_s: float) -> None: ...
    def file_done(self, transcript: Transcript) -> None: ...
