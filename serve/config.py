"""Server options (everything but the engine's own, which are ``LlmArgs``).

Pure Python: the CLI builds and validates this before fastapi or torch are imported, so a
bad option is a usage error (exit 2) and never a half-started server.
"""
from __future__ import annotations

from dataclasses import dataclass

# serve's CLI and app build the engine's options as every command does.
from enc2dec.engine.launch import build_llm_args  # noqa: F401

API_KEY_ENV = "ENC2DEC_API_KEY"
# enc2dec.engine.whisper.transcribe.STRATEGIES, restated: that module imports numpy and the engine.
LONG_FORM_STRATEGIES = ("vad", "chunked", "sequential")


@dataclass(frozen=True)
class ServeConfig:
    model: str                              # what the engine loads (folder or hub id)
    served_model_names: tuple[str, ...] = ()   # names clients use; default: the model argument
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None              # when set, every endpoint but /health needs "Bearer <key>"
    max_queue: int = 256                    # decoder sequences (prompts x n x beams) waiting before 503s
    max_upload_bytes: int = 25 << 20        # any request body (OpenAI's audio file limit is 25 MB)
    max_prompt_tokens: int | None = None    # tighter than the engine's max_input_len, if set
    max_audio_s: float = 3600.0             # longer uploads are refused (long-form decodes 30 s windows)
    long_form_strategy: str = "vad"         # audio over 30 s: enc2dec.engine.whisper.transcribe's strategy
    retry_after_s: int = 1                  # Retry-After on 503s
    drain_timeout_s: float = 600.0          # SIGTERM: longest wait for in-flight requests
    request_timeout_s: float = 60.0         # longest time a request body may take to arrive
    keep_alive_s: float = 5.0               # an idle keep-alive connection is closed after this
    allowed_origins: tuple[str, ...] = ()   # CORS: browser origins allowed to call the API (off when empty)
    log_level: str = "info"
    api_processes: int | None = None        # HTTP processes over the one engine process; None: auto (server.py)

    def __post_init__(self):
        if not self.model:
            raise ValueError("a model is required (a Hugging Face folder or hub id)")
        if not self.served_model_names:
            object.__setattr__(self, "served_model_names", (self.model,))
        if any(not n for n in self.served_model_names):
            raise ValueError("--served-model-name must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535] (0 picks a free port), got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        for name, lo in (("max_queue", 1), ("max_upload_bytes", 1), ("retry_after_s", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < lo:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {value!r}")
        if self.api_processes is not None and (not isinstance(self.api_processes, int) or self.api_processes < 1):
            raise ValueError(f"--api-processes must be an integer >= 1, got {self.api_processes!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 0 < self.max_audio_s:
            raise ValueError(f"--max-audio-s must be > 0, got {self.max_audio_s}")
        if self.long_form_strategy not in LONG_FORM_STRATEGIES:
            raise ValueError(f"--long-form-strategy {self.long_form_strategy!r} is not valid; valid: "
                             f"{', '.join(LONG_FORM_STRATEGIES)}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        for name in ("request_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        valid = ("critical", "error", "warning", "info", "debug")
        if self.log_level.lower() not in valid:
            raise ValueError(f"--log-level {self.log_level!r} is not valid; valid: {', '.join(valid)}")
        object.__setattr__(self, "log_level", self.log_level.lower())

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_model_names[0]

    def accepts_model(self, name: str | None) -> bool:
        """A request may name any served name or the model argument; omitting it means the default."""
        return not name or name in self.served_model_names or name == self.model

