"""Whisper's special tokens (start, languages, tasks, timestamps) and decoder prefixes.

The ids come from the generation config (``lang_to_id``, ``task_to_id``,
``no_timestamps_token_id``), so they also exist for dummy checkpoints that have no
tokenizer. Timestamp tokens follow ``<|notimestamps|>``: ``<|0.00|>``, ``<|0.02|>``, ...,
``<|30.00|>``, 1501 of them, one every ``TIME_PRECISION_S``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TIME_PRECISION_S = 0.02
NUM_TIMESTAMP_TOKENS = 1501
_SPECIAL = re.compile(r"<\|[^|]*\|>")


def _lookup_language_names() -> tuple[dict[str, str], dict[str, str]]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return LANGUAGES, TO_LANGUAGE_CODE


def language_name(code: str) -> str:
    names, _ = _lookup_language_names()
    return names.get(code, code).title()


@dataclass(frozen=True)
class WhisperTokens:
    sot: int
    eot: int
    no_timestamps: int
    languages: dict[str, int]            # language code ("en") -> token id
    tasks: dict[str, int]                # "transcribe" / "translate" -> token id
    is_multilingual: bool
    vocab_size: int
    begin_suppress: tuple[int, ...] = ()

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def has_timestamps(self) -> bool:
        return self.timestamp_begin + NUM_TIMESTAMP_TOKENS <= self.vocab_size

    def timestamp_at(self, seconds: float) -> int:
        """The timestamp token at or just before ``seconds`` into the window (clamped to the range)."""
        return self.timestamp_begin + min(max(int(seconds / TIME_PRECISION_S + 1e-6), 0), NUM_TIMESTAMP_TOKENS - 1)

    @classmethod
    def from_generation_config(cls, gen, vocab_size: int, tokenizer=None) -> WhisperTokens:
        def tok_id(name: str) -> int | None:
            if tokenizer is None:
                return None
            i = tokenizer.convert_tokens_to_ids(name)
            return None if i is None or i == getattr(tokenizer, "unk_token_id", None) else int(i)

        def first(value):
            return int(value[0] if isinstance(value, (list, tuple)) else value) if value is not None else None

        sot = first(getattr(gen, "decoder_start_token_id", None)) or tok_id("<|startoftranscript|>")
        eot = first(getattr(gen, "eos_token_id", None))
        no_ts = getattr(gen, "no_timestamps_token_id", None) or tok_id("<|notimestamps|>")
        if sot is None or eot is None or no_ts is None:
            raise ValueError("this Whisper checkpoint's generation_config.json lacks decoder_start_token_id, "
                             "eos_token_id or no_timestamps_token_id, and no tokenizer supplies them")
        languages = {k.strip("<|>"): int(v) for k, v in (getattr(gen, "lang_to_id", None) or {}).items()}
        tasks = {k: int(v) for k, v in (getattr(gen, "task_to_id", None) or {}).items()}
        for task in ("transcribe", "translate"):
            if task not in tasks and (i := tok_id(f"<|{task}|>")) is not None:
                tasks[task] = i
        multilingual = getattr(gen, "is_multilingual", None)
        if multilingual is None:
            multilingual = vocab_size >= 51865
        return cls(sot=int(sot), eot=int(eot), no_timestamps=int(no_ts), languages=languages, tasks=tasks,
                   is_multilingual=bool(multilingual), vocab_size=int(vocab_size),
                   begin_suppress=tuple(int(t) for t in getattr(gen, "begin_suppress_tokens", None) or ()))

    # ---- languages and prefixes ---------------------------------------------------------
    def language_code(self, language: str) -> str:
        """``en``, ``English`` or ``<|en|>`` -> ``en``; a clear error for unknown languages."""
        _, to_code = _lookup_language_names()
        key = language.strip().lower().strip("<|>")
        code = key if key in self.languages else to_code.get(key, key)
        if not self.is_multilingual:
            if code != "en":
                raise ValueError(f"language {language!r}: this checkpoint is English-only")
            return "en"
        if code not in self.languages:
            sample = ", ".join(sorted(self.languages)[:12])
            raise ValueError(f"language {language!r} is not one this checkpoint knows; valid codes include "
                             f"{sample}{', ...' if len(self.languages) > 12 else ''} (or names such as 'english')")
        return code

    def check_task(self, task: str) -> None:
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task {task!r} is not valid; valid: transcribe, translate")
        if self.is_multilingual and task not in self.tasks:
            raise ValueError(f"task {task!r}: the generation config has no task_to_id entry for it")
        if not self.is_multilingual and task == "translate":
            raise ValueError("task 'translate' needs a multilingual checkpoint; this one is English-only")

    def prefix(self, language: str | None, task: str, timestamps: bool) -> list[int]:
        """The decoder prefix; ``language=None`` on a multilingual checkpoint gives only
        ``<|startoftranscript|>`` (the language is then detected as the first output token)."""
        if self.is_multilingual and language is None:
            return [self.sot]
        ids = [self.sot]
        if self.is_multilingual:
            ids += [self.languages[language], self.tasks[task]]
        if not timestamps:
            ids.append(self.no_timestamps)
        return ids

    def forced_after_language(self, task: str, timestamps: bool) -> list[int]:
        """What follows a detected language token: the task, then ``<|notimestamps|>`` if asked."""
        return [self.tasks[task]] + ([] if timestamps else [self.no_timestamps])

    def text_ids(self, ids: list[int]) -> list[int]:
        # Every special token (EOT, start, languages, tasks, timestamps) sorts at or after EOT.
        return [t for t in ids if t < self.eot]


MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first segment starts within 1.0 s of the window


def decoding_rules(tokens: WhisperTokens, *, detect_language: bool, timestamps: bool, task: str = "transcribe",
                   max_initial_timestamp_index: int | None = None,
                   open_segment_at: int | None = None, end_not_before: int | None = None) -> tuple[list, int]:
    """The logits processors of one 30 s window (``SamplingParams.logits_processors``) and how many
    forced tokens precede its text. ``detect_language``: the first output token is chosen among the
    language tokens, then the task (and ``<|notimestamps|>`` without timestamps) are forced; the
    prefix is then ``<|startoftranscript|>`` alone. ``timestamps``: Whisper's timestamp rules
    (``open_segment_at``: the prompt ends inside a segment it opened: a forced prefix). The
    processors hold no per-request state, so one list serves every window with these options."""
    from enc2dec.engine.whisper.rules import DetectLanguage, SuppressAtBegin, TimestampRules

    processors, begin = [], 0
    if detect_language:
        forced = tokens.forced_after_language(task, timestamps)
        begin = 1 + len(forced)
        processors += [DetectLanguage(list(tokens.languages.values()), forced),
                       SuppressAtBegin(begin, tokens.begin_suppress)]
    if timestamps:
        processors.append(TimestampRules(begin, tokens.eot, tokens.no_timestamps, tokens.timestamp_begin,
                                         max_initial_timestamp_index, open_segment_at, end_not_before))
    return processors, begin


class IdOnlyTokenizer:
    """A stand-in tokenizer for checkpoints without one (dummy weights): it encodes strings
    of special tokens (``<|startoftranscript|><|en|>...``), so decoder prefixes can be given,
    and decodes text tokens as ``<id>`` placeholders."""

    def __init__(self, tokens: WhisperTokens):
        self.eos_token_id = tokens.eot
        self.unk_token_id = None
        self._ids = {"<|startoftranscript|>": tokens.sot, "<|endoftext|>": tokens.eot,
                     "<|notimestamps|>": tokens.no_timestamps}
        self._ids.update({f"<|{code}|>": i for code, i in tokens.languages.items()})
        self._ids.update({f"<|{task}|>": i for task, i in tokens.tasks.items()})
        self._names = {i: name for name, i in self._ids.items()}
        self._eot = tokens.eot

    def __len__(self) -> int:
        return max(self._ids.values()) + 1

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._ids.get(tokens)
        return [self._ids.get(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._names.get(ids, f"<{ids}>")
        return [self._names.get(i, f"<{i}>") for i in ids]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = _SPECIAL.findall(text)
        if "".join(pieces) != text or any(p not in self._ids for p in pieces):
            raise ValueError("this model has no tokenizer: only special-token prompts such as "
                             "'<|startoftranscript|><|en|><|transcribe|>' can be encoded")
        return [self._ids[p] for p in pieces]

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self._eot]
        return "".join(self._names.get(i, f"<{i}>") for i in ids)


def with_stand_in_tokenizer(args):
    """``args`` (LlmArgs) with the stand-in tokenizer for ``load_format='dummy'`` on a
    well-known Whisper name (no files, so no tokenizer): decoder prefixes can then be given as
    special-token strings. Unchanged where a tokenizer is set or the checkpoint brings one."""
    import dataclasses
    import os

    from enc2dec.engine.inputs.known_configs import KNOWN_MODELS, get_known_config, get_known_generation_config

    model = args.model
    if args.tokenizer is not None or args.load_format != "dummy" or os.path.isdir(model):
        return args
    # Only the names that load_format='dummy' builds without files (model_source.py); any other
    # name fails there with the list of known ones.
    if model not in KNOWN_MODELS or get_known_config(model).model_type != "whisper":
        return args
    tokens = WhisperTokens.from_generation_config(get_known_generation_config(model),
                                                  get_known_config(model).vocab_size)
    return dataclasses.replace(args, tokenizer=IdOnlyTokenizer(tokens))


def engine_whisper_info(llm):
    """(WhisperTokens, feature extractor, max decoder positions) of a running Whisper LLM."""
    core = llm.engine
    if core.hf_config.model_type != "whisper":
        raise ValueError(f"transcribe needs a Whisper checkpoint; {llm.args.model} is a "
                         f"{core.hf_config.model_type} model")
    proc = core.processor
    tokens = WhisperTokens.from_generation_config(proc.gen, core.hf_config.vocab_size, llm.tokenizer)
    return tokens, proc.feature_extractor, getattr(core.hf_config, "max_target_positions", 448)
