"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable


def plain_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, through the Rust tokenizer
    directly where the class adds nothing that can be redone cheaply. A streamed sequence decodes
    every step, and ``decode``'s Python layers cost 2.5-10x the Rust decode itself (4.0 against
    1.4 us for a T5 or BART window of 12 ids; 9.8 us a token for Whisper's, whose class strips
    prompts and timestamp tokens around it): with hundreds of streams that is a share of the
    host's step. Made once per tokenizer and flag (cached).

    - A fast tokenizer whose class overrides neither ``decode`` nor ``_decode`` and does no
      clean-up of the decoded text: the Rust decode, as is.
    - Whisper's class (``WhisperTokenizer`` as transformers has it, not a subclass that changes
      it) and a plain class that cleans up spaces: the Rust decode followed by what the class
      does to its text (timestamp tokens filtered out, the clean-up), taken only if it gives
      ``decode``'s text on a probe of windows (special, timestamp and punctuation ids: what
      transformers' versions differ in); a window holding Whisper's prompt token goes to
      ``decode`` (it strips the prompt).
    Anything else goes through ``decode``."""
    key = bool(skip_special_tokens)
    try:
        cached = _DECODERS.get(tokenizer)
    except TypeError:                       # not weakly referable: no cache
        return _make_decoder(tokenizer, key)
    if cached is None:
        cached = _DECODERS[tokenizer] = {}
    if key not in cached:
        cached[key] = _make_decoder(tokenizer, key)
    return cached[key]


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _make_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    slow = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return slow
    cls, backend = type(tokenizer), getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return slow
    direct = functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    plain = cls.decode is PreTrainedTokenizerFast.decode and cls._decode is PreTrainedTokenizerFast._decode
    if plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return direct
    # The Rust decode as is, and with the clean-up transformers may apply after it.
    cleanup = getattr(tokenizer, "clean_up_tokenization", None)
    candidates = [direct] + ([lambda ids: cleanup(direct(ids))] if cleanup is not None else [])
    if not plain:
        whisper = _whisper_filter(tokenizer, cls, slow, skip_special_tokens)
        if whisper is None:
            return slow
        candidates = [whisper(text) for text in candidates]
    try:
        probe = _probe_windows(tokenizer)
        return next((fast for fast in candidates if all(fast(ids) == slow(ids) for ids in probe)), slow)
    except Exception:  # noqa: BLE001 - a tokenizer the probe cannot drive keeps its own decode
        return slow


def _whisper_filter(tokenizer, cls, slow, skip_special_tokens: bool):
    """Whisper's ``decode`` is the plain decode with the prompt (``<|startofprev|>`` ... up to
    ``<|startoftranscript|>``) stripped first when skipping special tokens and the timestamp tokens'
    text removed after. Returns what wraps a text decoder to redo the second and hand a window
    with the first to ``slow``; None for any other class."""
    try:
        from transformers.models.whisper.tokenization_whisper import WhisperTokenizer
    except ImportError:
        return None
    pattern = getattr(tokenizer, "timestamp_pat", None)
    if (not isinstance(tokenizer, WhisperTokenizer) or cls.decode is not WhisperTokenizer.decode
            or cls._decode is not WhisperTokenizer._decode or pattern is None):
        return None
    strip = pattern.sub
    prompt_id = tokenizer.convert_tokens_to_ids("<|startofprev|>") if skip_special_tokens else None

    def wrap(text: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
        def filtered(ids: list[int]) -> str:
            return slow(ids) if prompt_id is not None and prompt_id in ids else strip("", text(ids))
        return filtered

    return wrap


_PROBE_TEXT = ("Grüße aus Köln , the cat 's mat . Isn 't it ? Yes ! I 'm , you 're , we 've , "
               "don 't do n't -- 日本語の文章 \"quoted\" (a) [b] 3.14 <|0.00|> <|1.20|> end")


def _probe_windows(tokenizer) -> list[list[int]]:
    """Id windows a fast decoder must decode as ``decode`` does: a text with the punctuation that
    clean-ups move and multi-byte characters that byte-level tokens split, its special tokens,
    timestamp tokens where the vocabulary has them, and random ids, cut as a stream cuts them."""
    import random

    ids = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
    special = sorted(getattr(tokenizer, "all_special_ids", []) or [])
    extra = [i for i in (tokenizer.convert_tokens_to_ids(t) for t in ("<|0.00|>", "<|1.20|>", "<|startofprev|>"))
             if isinstance(i, int) and i != tokenizer.unk_token_id]
    rng = random.Random(0)
    windows = [ids] + [ids[i:i + n] for n in (1, 2, 5, 12) for i in range(0, len(ids), max(1, n // 2))]
    for _ in range(64):
        windows.append([rng.choice(special + extra) if (special or extra) and rng.random() < 0.25 else
                        rng.choice(ids) if ids and rng.random() < 0.5 else rng.randrange(len(tokenizer))
                        for _ in range(rng.randrange(1, 16))])
    return windows


class IncrementalDetokenizer:
    """Keeps the decoded text of a growing token list and finds stop strings.

    Text is re-decoded from a window that starts a few tokens before the last emitted
    boundary, so multi-token characters (byte-level BPE, ByT5) come out whole: a trailing
    U+FFFD means the character is not complete yet and is held back. The window's start moves
    only every ``_WINDOW`` tokens, so the text of the window already read is the previous
    step's decode: one tokenizer call per step, not two.
    """

    _WINDOW = 6

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = plain_decoder(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self._token_ids: list[int] = []   # every token fed so far
        self._prefix_offset = 0     # token index where the decode window starts
        self._read_offset = 0       # tokens already reflected in self.text
        self._prefix_text = ""      # decode of ids[_prefix_offset:_read_offset]
        self.stop_matched: str | None = None
        self._emitted = 0           # characters of self.text already returned
        # finish() found a whole-output decode that does not extend what was already returned:
        # its text replaces the streamed pieces.
        self.rewritten = False

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far: the next ``add`` takes the ones after these."""
        return len(self._token_ids)

    @property
    def num_emitted(self) -> int:
        """Characters of ``text`` that are final: what a stream may show. The rest may be the
        start of a stop string and can still be cut."""
        return self._emitted

    def update(self, token_ids: list[int]) -> str:
        """Feed the whole output token list; returns the new text (possibly empty)."""
        return self.add(token_ids[len(self._token_ids):])

    def add(self, new_token_ids: list[int]) -> str:
        """Feed the tokens after the ones already fed; returns the new text (possibly empty).
        The work is bounded by the decode window, not by the length of the output."""
        ids = self._token_ids
        ids += new_token_ids
        if self.tokenizer is None or self.stop_matched is not None or not new_token_ids:
            return ""
        prefix_text = self._prefix_text
        full = self._decode(ids[self._prefix_offset:])
        if not full.startswith(prefix_text) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix_text):]
        self._read_offset = len(ids)
        if len(ids) - self._prefix_offset > 2 * self._WINDOW:
            self._prefix_offset = len(ids) - self._WINDOW
            self._prefix_text = self._decode(ids[self._prefix_offset:])
        else:
            self._prefix_text = full
        if self.stop:
            return self._append(delta)
        self.text += delta                  # nothing to hold back: every character is final
        self._emitted = len(self.text)
        return delta

    def _append(self, delta: str) -> str:
        start = len(self.text)
        self.text += delta
        if self.stop and delta:
            # A stop string may straddle the old/new boundary.
            search_from = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                i, s = min(hits)
                self.stop_matched = s
                self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return self._emit(final=self.stop_matched is not None)

    def _emit(self, final: bool) -> str:
        # While a stop string could still be completing, hold back its possible prefix.
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self._emitted, len(self.text) - hold)
        piece = self.text[self._emitted:end]
        self._emitted = end
        return piece

    def finish(self, token_ids: list[int]) -> str:
        """Decode whatever is held back (the final text is exact, not incremental)."""
        if self.tokenizer is None:
            return ""
        if self.stop_matched is None:
            full = self._decode(token_ids)
            if full.startswith(self.text):
                return self._append(full[len(self.text):]) + self._emit(final=True)
            if not full.startswith(self.text[:self._emitted]):
                self.rewritten, self._emitted = True, 0
            self.text = full
        return self._emit(final=True)
