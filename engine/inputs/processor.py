"""Turns a user prompt into an encoder input and a decoder prefix, and rejects bad input.

Text models: the prompt (string or encoder token ids) is the encoder input; the decoder
starts from ``decoder_start_token_id`` (else ``bos_token_id``), plus ``forced_bos_token_id``
when the checkpoint defines one. Whisper: the audio is the encoder input and the text
prompt (or ``prompt_token_ids``), when given, replaces the decoder prefix verbatim.
"""
from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("enc2dec")

WHISPER_SAMPLE_SECONDS = 30


@dataclass
class ProcessedInput:
    prompt: str | None
    prompt_token_ids: list[int]     # encoder token ids (empty for Whisper)
    encoder_input: Any              # list[int] or a [n_mels, frames] float32 array
    encoder_len: int
    decoder_prefix: list[int]
    num_hidden_tokens: int          # prefix tokens not returned to the user
    max_output_tokens: int
    audio_seconds: float = 0.0
    encoder_cache_key: str | None = None    # the caller's name for the encoder input (multi_modal_uuids)


def _token_ids(values) -> list[int]:
    """Token ids as ints; a bool, a float or a string is a caller's mistake, not an id."""
    ids = list(values)
    # Plain ints (the usual case) pass on an exact type check: the ABC check below costs ~0.2 ms
    # per 128-token prompt, which a wave of 256 requests paid before its first token.
    if all(type(t) is int for t in ids):
        return ids
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt token ids must be integers, got {bad[0]!r}")
    return [int(t) for t in ids]


def _first_int(*values):
    for v in values:
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return None


def _all_ints(*values) -> list[int]:
    for v in values:
        if v is None:
            continue
        return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return []


def _audio_uuid(uuids) -> str | None:
    """The clip's key from ``multi_modal_uuids`` (vLLM's shape: ``{"audio": ["key"]}``, one per clip).
    Requests whose clips share a key share the encoder's output: equal keys must mean equal audio."""
    if uuids is None:
        return None
    keys = uuids.get("audio") if isinstance(uuids, dict) else None
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, (list, tuple)) or len(keys) != 1 or not (keys[0] is None or isinstance(keys[0], str)):
        raise ValueError(f"multi_modal_uuids must be {{'audio': [key]}} with one string key (or None) for the "
                         f"request's one clip, got {uuids!r}")
    return keys[0] or None


class InputProcessor:
    def __init__(self, hf_config, generation_config, tokenizer, max_input_len: int,
                 max_seq_len: int | None, feature_extractor=None, log_mel=None):
        self.config = hf_config
        self.gen = generation_config
        self.tokenizer = tokenizer
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.feature_extractor = feature_extractor
        self.log_mel = log_mel      # set by the engine: audio stays raw until the runner's log-mel
        self.is_whisper = hf_config.model_type == "whisper"
        self.vocab_size = hf_config.vocab_size
        g = generation_config
        self.decoder_start_token_id = _first_int(getattr(g, "decoder_start_token_id", None),
                                                 getattr(hf_config, "decoder_start_token_id", None),
                                                 getattr(g, "bos_token_id", None),
                                                 getattr(hf_config, "bos_token_id", None))
        if self.decoder_start_token_id is None:
            raise ValueError("the checkpoint defines neither decoder_start_token_id nor bos_token_id in "
                             "config.json or generation_config.json; the decoder cannot be started. Add one "
                             "of them to the checkpoint's config")
        self.forced_bos_token_id = None if self.is_whisper else _first_int(
            getattr(g, "forced_bos_token_id", None), getattr(hf_config, "forced_bos_token_id", None))
        self.eos_token_ids = tuple(_all_ints(getattr(g, "eos_token_id", None),
                                             getattr(hf_config, "eos_token_id", None),
                                             getattr(tokenizer, "eos_token_id", None)))
        pos = getattr(hf_config, "max_target_positions", None) if self.is_whisper else (
            getattr(hf_config, "max_position_embeddings", None) if hf_config.model_type in ("bart", "mbart")
            else None)
        self.max_decoder_positions = pos
        # BART/mBART learn a position table for the encoder too; a longer prompt cannot be encoded.
        self.max_encoder_positions = getattr(hf_config, "max_position_embeddings", None) \
            if hf_config.model_type in ("bart", "mbart") else None
        self.suppress_token_ids = tuple(getattr(g, "suppress_tokens", None) or ()) if self.is_whisper else ()
        self.begin_suppress_token_ids = tuple(getattr(g, "begin_suppress_tokens", None) or ()) \
            if self.is_whisper else ()
        self.whisper_default_prefix = self._default_whisper_prefix() if self.is_whisper else []
        for name in ("suppress_token_ids", "begin_suppress_token_ids"):
            ids = getattr(self, name)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:   # e.g. WhisperConfig defaults on a smaller vocabulary: drop them, say so
                logger.warning("generation config %s %s lie outside the vocabulary (%d); ignored",
                               name.replace("_token_ids", "_tokens"), bad[:5], self.vocab_size)
                setattr(self, name, tuple(t for t in ids if 0 <= t < self.vocab_size))

    # ---- decoder prefix -------------------------------------------------------------------
    def _text_prefix(self) -> tuple[list[int], int]:
        if self.forced_bos_token_id is not None:
            return [self.decoder_start_token_id, self.forced_bos_token_id], 1
        return [self.decoder_start_token_id], 1

    def _whisper_prefix(self, prompt: str | None, ids: list[int] | None = None) -> list[int]:
        """The decoder prefix: ``ids`` (``prompt_token_ids``) or the encoded ``prompt``, which must
        begin with <|startoftranscript|>, or with <|startofprev|> + previous text followed by it
        (the original Whisper's conditioning: the whole prefix is hidden, never output)."""
        if ids is None and not prompt:
            return list(self.whisper_default_prefix)
        if ids is None:
            tok = self._require_tokenizer("a Whisper decoder prompt")
            ids = tok.encode(prompt, add_special_tokens=False)
        else:
            ids = _token_ids(ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"decoder prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        shown = prompt[:60] if prompt else ids[:8]
        sot, prev = self.decoder_start_token_id, self._start_of_prev()
        if not ids or (ids[0] != sot and not (prev is not None and ids[0] == prev and sot in ids)):
            raise ValueError("a non-empty Whisper prompt must begin with <|startoftranscript|>, or with "
                             "<|startofprev|> and previous text followed by <|startoftranscript|> (it replaces "
                             f"the decoder prefix verbatim); got {shown!r}")
        return ids

    def _start_of_prev(self) -> int | None:
        value = getattr(self.gen, "prev_sot_token_id", None)
        if value is None and self.tokenizer is not None:
            value = self.tokenizer.convert_tokens_to_ids("<|startofprev|>")
            value = None if value == getattr(self.tokenizer, "unk_token_id", None) else value
        return None if value is None else int(value)

    def _default_whisper_prefix(self) -> list[int]:
        """<|startoftranscript|><|en|><|transcribe|><|notimestamps|> on multilingual checkpoints, the
        checkpoint's own default (<|startoftranscript|><|notimestamps|>) on English-only ones. Ids
        come from the generation config when it has them, so dummy models need no tokenizer."""
        g, tok = self.gen, self.tokenizer
        multilingual = getattr(g, "is_multilingual", None)
        if multilingual is None:
            multilingual = self.vocab_size >= 51865

        def special(name: str, table: str | None = None, key: str | None = None, attr: str | None = None):
            value = (getattr(g, table, None) or {}).get(key) if table else getattr(g, attr, None)
            if value is None and tok is not None:
                value = tok.convert_tokens_to_ids(name)
            if value is None:
                raise ValueError(f"the checkpoint's generation config lacks the id of {name} and there is no "
                                 "tokenizer to look it up; pass a Whisper prompt with a tokenizer")
            return int(value)

        prefix = [self.decoder_start_token_id]
        if multilingual:
            prefix += [special("<|en|>", "lang_to_id", "<|en|>"), special("<|transcribe|>", "task_to_id", "transcribe")]
        return prefix + [special("<|notimestamps|>", attr="no_timestamps_token_id")]

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this model has none (dummy weights or a folder "
                             "without tokenizer files); pass token ids or LLM(tokenizer=...)")
        return self.tokenizer

    # ---- public ---------------------------------------------------------------------------
    def process(self, prompt, max_tokens: int) -> ProcessedInput:
        if self.is_whisper:
            return self._process_audio(prompt, max_tokens)
        text, ids = None, None
        if isinstance(prompt, str):
            text = prompt
            tok = self._require_tokenizer("a text prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:     # a lone surrogate: the tokenizer would raise TypeError
                raise ValueError(f"the prompt is not valid Unicode text (at character {e.start})") from None
            ids = list(tok.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                raise ValueError(f"{self.config.model_type} takes text, not multi_modal_data")
            if "prompt_token_ids" in prompt:
                ids = _token_ids(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                return self.process(prompt["prompt"], max_tokens)
            else:
                raise ValueError("a prompt mapping needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist") and not isinstance(prompt, str)):
            ids = _token_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        else:
            raise ValueError(f"unsupported prompt type {type(prompt).__name__}; pass a string, a list of "
                             "token ids or a mapping with 'prompt' / 'prompt_token_ids'")
        if not ids:
            raise ValueError("the prompt is empty: the encoder needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_input_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_input_len={self.max_input_len}; "
                             "shorten it or raise max_input_len")
        if self.max_encoder_positions is not None and len(ids) > self.max_encoder_positions:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than this model's encoder position "
                             f"table ({self.max_encoder_positions} positions); shorten it")
        prefix, hidden = self._text_prefix()
        if self.forced_bos_token_id is not None and max_tokens < 2:
            raise ValueError(f"max_tokens={max_tokens} is too small: this checkpoint forces a BOS token "
                             f"({self.forced_bos_token_id}) that counts against max_tokens, so it must be >= 2")
        max_out = self._cap_output(max_tokens, hidden)
        return ProcessedInput(text, ids, ids, len(ids), prefix, hidden, max_out)

    def _cap_output(self, max_tokens: int, hidden: int) -> int:
        # Output tokens are token_ids[hidden:], so the whole sequence is hidden + output long.
        limit = None
        if self.max_decoder_positions is not None:
            limit = self.max_decoder_positions - hidden
        if self.max_seq_len is not None:
            seq_limit = self.max_seq_len - hidden
            limit = seq_limit if limit is None else min(limit, seq_limit)
        if limit is not None and max_tokens > limit:
            logger.warning("max_tokens=%d exceeds the decoder position table; capped to %d", max_tokens, limit)
            return limit
        return max_tokens

    def _process_audio(self, prompt, max_tokens: int) -> ProcessedInput:
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            raise ValueError("Whisper takes audio: pass {'prompt': '', 'multi_modal_data': {'audio': [clip]}} "
                             "with clip a file path, an (array, sample_rate) tuple or "
                             "{'array': ..., 'sampling_rate': ...}")
        clips = (prompt.get("multi_modal_data") or {}).get("audio")
        if isinstance(clips, list):
            if len(clips) != 1:
                raise ValueError(f"supply exactly one audio clip per request, got {len(clips)}")
            clip = clips[0]
        else:
            clip = clips
        wave, rate = self._read_clip(clip)
        fe = self.feature_extractor
        expected = fe.sampling_rate
        if rate != expected:
            raise ValueError(f"audio sampling rate {rate} Hz does not match the checkpoint's {expected} Hz; "
                             "resample it first (enc2dec transcribe does this for you)")
        seconds = len(wave) / rate
        if seconds > WHISPER_SAMPLE_SECONDS + 1e-6:
            raise ValueError(f"audio is {seconds:.1f} s long; the engine API takes at most "
                             f"{WHISPER_SAMPLE_SECONDS} s per request (use enc2dec transcribe for long audio)")
        if len(wave) == 0:
            raise ValueError("the audio clip is empty")
        if self.log_mel is not None:
            # The runner computes the features (on the GPU for the whole microbatch; on the CPU on
            # the engine thread, log_mel.ExtractorLogMel says why).
            encoder_input = self.log_mel.clip(wave)                                   # [<= n_samples]
        else:
            encoder_input = fe(wave, sampling_rate=rate, return_tensors="np").input_features[0]  # [n_mels, 3000]
            encoder_input = encoder_input.astype(np.float32)
        prefix = self._whisper_prefix(prompt.get("prompt"), prompt.get("prompt_token_ids"))
        max_out = self._cap_output(max_tokens, len(prefix))
        enc_len = fe.nb_max_frames // 2
        return ProcessedInput(prompt.get("prompt") or "", [], encoder_input, enc_len, prefix,
                              len(prefix), max_out, seconds, _audio_uuid(prompt.get("multi_modal_uuids")))

    @staticmethod
    def _read_clip(clip) -> tuple[np.ndarray, int]:
        if isinstance(clip, dict):
            if "array" not in clip or "sampling_rate" not in clip:
                raise ValueError("an audio mapping needs 'array' and 'sampling_rate'")
            wave, rate = clip["array"], clip["sampling_rate"]
        elif isinstance(clip, tuple) and len(clip) == 2:
            wave, rate = clip
        elif isinstance(clip, str):
            try:
                import soundfile
            except ImportError:
                raise ValueError("reading audio files needs soundfile: pip install 'enc2dec[audio]'") from None
            try:
                wave, rate = soundfile.read(clip, dtype="float32")
            except Exception as e:  # noqa: BLE001 - libsndfile raises several types
                raise ValueError(f"cannot read audio file {clip}: {e}") from None
        else:
            raise ValueError(f"unsupported audio item {type(clip).__name__}; pass a path, (array, rate) or "
                             "{'array', 'sampling_rate'}")
        wave = np.asarray(wave, dtype=np.float32)
        if wave.ndim == 2:
            raise ValueError("the engine takes mono audio; mix channels down first "
                             "(enc2dec transcribe does this for you)")
        if wave.ndim != 1:    # caught here, not at its encode on the engine thread
            raise ValueError(f"an audio clip is a 1-D array of samples, got shape {wave.shape}")
        return wave, int(rate)
