"""The Rich progress bar of ``enc2dec transcribe`` (stderr): audio seconds done, speed in
audio seconds per wall second (the ``rtf`` of ``enc2dec bench``), one line per detected
language. Stdout stays clean for the transcripts."""
from __future__ import annotations

import contextlib
import time

from enc2dec.engine.whisper.results import TranscribeProgress


class QuietProgress(TranscribeProgress):
    report_language = False

    def status(self, message: str):
        return contextlib.nullcontext()

    def stop(self) -> None:
        pass


class RichProgress(TranscribeProgress):
    def __init__(self, report_language: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.report_language = report_language
        self._bar = Progress(
            SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} s audio"), TimeElapsedColumn(),
            TextColumn("{task.fields[speed]}"), console=self.console, transient=False,
            redirect_stdout=False, redirect_stderr=False)
        self._task = None
        self._t0 = 0.0
        self._files = self._done = 0

    def status(self, message: str):
        return self.console.status(message)

    def start(self, total_audio_s: float) -> None:
        self._t0 = time.perf_counter()
        self._bar.start()
        self._task = self._bar.add_task("transcribing", total=max(total_audio_s, 1e-9), speed="")

    def advance(self, audio_s: float) -> None:
        if self._task is None or audio_s <= 0:
            return
        elapsed = time.perf_counter() - self._t0
        done = self._bar.tasks[0].completed + audio_s
        self._bar.update(self._task, advance=audio_s, speed=f"{done / elapsed:.1f}x real time" if elapsed else "")

    def file_done(self, transcript) -> None:
        from enc2dec.engine.whisper.tokens import language_name

        self._done += 1
        if self._task is not None:
            self._bar.update(self._task, description=f"transcribing ({self._done} files done)")
        if transcript.error is None and self.report_language and transcript.language:
            self._bar.console.print(f"{transcript.source}: detected language "
                                    f"{language_name(transcript.language)} ({transcript.language})")

    def stop(self) -> None:
        self._bar.stop()


def make_progress(quiet: bool):
    return QuietProgress() if quiet else RichProgress()
