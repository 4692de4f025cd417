"""Whisper application code on top of the engine: reading audio, log-mel features, the
special tokens and their rules (timestamps, language), long-form strategies, the
transcription pipeline and subtitle writers."""
