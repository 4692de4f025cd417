"""Transcribe audio files of any length with a Whisper ``LLM``: the library under
``enc2dec transcribe``.

    from enc2dec.engine import LLM, KvCacheConfig
    from enc2dec.engine.whisper.transcribe import transcribe

    with LLM("openai/whisper-base", kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)) as llm:
        for t in transcribe(llm, ["talk.mp3", "call.flac"], timestamps=True):
            print(t.source, t.language, t.error or t.text)

Every 30 s window of every file is one engine request; up to ``batch_size`` are in flight
at once, so windows of many files (and, with the vad and chunked strategies, of one long
file) decode together in the engine's batches. A file of at most 30 s is one window whatever
the strategy (the same tokens as transformers' short-form ``generate``); longer files follow
``strategy``: vad by default, the most accurate on the long-form measurements of
docs/transcribe.md (it needs silero-vad, part of the ``audio`` extra; only for such files).
A file that cannot be read or decoded gets ``Transcript.error``; the others are unaffected.
Long-form rules: ``longform.py``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import math
import uuid
from collections.abc import Sequence

import numpy as np

from enc2dec.engine.whisper.audio import AudioError, load_audio, probe_duration_s, resample, to_mono
from enc2dec.engine.whisper.longform import (CHUNK_OVERLAP_S, MIN_WINDOW_S, RETRY_GAP_S, WINDOW_S, Merged, Piece,
                                             chunk_windows, closed_pieces, merge_chunk, merged_pieces, monotonic,
                                             parse_window, unheard_from)
from enc2dec.engine.sampling_params import SamplingParams
from enc2dec.engine.whisper.decoding import (MAX_PROMPT_TOKENS, DecodeOptions, WindowStats, avg_logprob, best_sample,
                                             compression_ratio, is_no_speech, kept_tokens, needs_fallback,
                                             next_previous_ids, prompt_tokens, temperatures)
from enc2dec.engine.whisper.results import Segment, Transcript, TranscribeProgress
from enc2dec.engine.whisper.tokens import MAX_INITIAL_TIMESTAMP_INDEX, decoding_rules, engine_whisper_info
from enc2dec.engine.whisper.vad import check_available, pack_windows, speech_regions

STRATEGIES = ("vad", "chunked", "sequential")
DEFAULT_STRATEGY = "vad"
TASKS = ("transcribe", "translate")
MAX_WINDOW_TOKENS = 224          # per window, as the original Whisper: half the decoder context


class _DecodeError(RuntimeError):
    pass


def transcribe(llm, sources: Sequence, *, language: str | None = None, task: str = "transcribe",
               strategy: str = DEFAULT_STRATEGY, timestamps: bool = False, batch_size: int = 32,
               progress: TranscribeProgress | None = None, beam_size: int = 1,
               temperature: float | Sequence[float] = 0.0, compression_ratio_threshold: float | None = 2.4,
               logprob_threshold: float | None = -1.0, no_speech_threshold: float | None = 0.6, best_of: int = 5,
               condition_on_previous_text: bool = False, initial_prompt: str | None = None,
               hotwords: str | None = None, prefix: str | None = None,
               word_timestamps: bool = False) -> list[Transcript]:
    """Transcripts in the order of ``sources`` (file paths, or ``(samples, sample_rate)``
    arrays). ``language=None`` detects it per file on multilingual checkpoints. ``strategy``
    decodes files over 30 s (``STRATEGIES``; vad needs silero-vad, checked before any decoding).
    ``beam_size`` > 1 decodes each window by beam search (the LLM needs ``max_beam_width >=
    beam_size``).
    ``word_timestamps`` fills ``Segment.words`` (it implies ``timestamps``; alignment.py).

    The original Whisper's options (``decoding.py``): ``temperature`` a list such as
    ``(0.0, 0.2, 0.4, 0.6, 0.8, 1.0)`` decodes a window again at the next temperature when its
    compression ratio or mean log-probability fails its threshold (``best_of`` samples above 0);
    windows likelier silence than speech (``no_speech_threshold``) give no text;
    ``condition_on_previous_text`` (sequential), ``initial_prompt`` and ``hotwords`` prompt the
    decoder, ``prefix`` forces the start of the first window's text. A threshold of None is off.
    Raises ``ValueError`` for bad options; per-file problems go to ``Transcript.error``."""
    return asyncio.run(transcribe_async(
        llm, sources, language=language, task=task, strategy=strategy, timestamps=timestamps,
        batch_size=batch_size, progress=progress, beam_size=beam_size, temperature=temperature,
        compression_ratio_threshold=compression_ratio_threshold, logprob_threshold=logprob_threshold,
        no_speech_threshold=no_speech_threshold, best_of=best_of,
        condition_on_previous_text=condition_on_previous_text, initial_prompt=initial_prompt, hotwords=hotwords,
        prefix=prefix, word_timestamps=word_timestamps))


async def transcribe_async(llm, sources: Sequence, *, language: str | None = None, task: str = "transcribe",
                           strategy: str = DEFAULT_STRATEGY, timestamps: bool = False, batch_size: int = 32,
                           progress: TranscribeProgress | None = None, beam_size: int = 1,
                           temperature: float | Sequence[float] = 0.0,
                           compression_ratio_threshold: float | None = 2.4, logprob_threshold: float | None = -1.0,
                           no_speech_threshold: float | None = 0.6, best_of: int = 5,
                           condition_on_previous_text: bool = False, initial_prompt: str | None = None,
                           hotwords: str | None = None, prefix: str | None = None,
                           word_timestamps: bool = False) -> list[Transcript]:
    options = DecodeOptions(temperatures(temperature), compression_ratio_threshold=compression_ratio_threshold,
                            logprob_threshold=logprob_threshold, no_speech_threshold=no_speech_threshold,
                            best_of=best_of, condition_on_previous_text=condition_on_previous_text,
                            initial_prompt=initial_prompt, hotwords=hotwords, prefix=prefix)
    run = _Run(llm, language, task, strategy, timestamps or word_timestamps, batch_size,
               progress or TranscribeProgress(), beam_size, options)
    if word_timestamps:
        from enc2dec.engine.whisper.alignment import WordAligner

        run.aligner = WordAligner(llm, run.tokens, run.sample_rate, task)
    named = [(_name(s, i), s) for i, s in enumerate(sources)]
    durations = [_probe(src) for _, src in named]
    if strategy == "vad" and any(isinstance(d, float) and d > WINDOW_S for d in durations):
        check_available()           # before any window decodes: a missing extra loses no work
    run.progress.start(sum(d for d in durations if isinstance(d, float)))
    try:
        return list(await asyncio.gather(*(run.file(name, src, d) for (name, src), d in zip(named, durations))))
    finally:
        run.submitter.shutdown(wait=False, cancel_futures=True)


def _name(source, index: int) -> str:
    return f"<array {index}>" if isinstance(source, tuple) else str(source)


def _probe(source) -> float | AudioError:
    """Seconds of audio (from the header for files), or the problem, known before decoding."""
    try:
        if isinstance(source, tuple):
            samples, rate = source
            if not isinstance(rate, (int, np.integer)) or rate <= 0:
                raise AudioError(f"the sample rate must be a positive integer, got {rate!r}")
            return _frames_first(np.asarray(samples)).shape[0] / int(rate)
        return probe_duration_s(str(source))
    except AudioError as e:
        return e


def _frames_first(samples: np.ndarray) -> np.ndarray:
    # Arrays from torchaudio / librosa are [channels, frames]; soundfile's are [frames, channels].
    if samples.ndim == 2 and samples.shape[0] <= 8 < samples.shape[1]:
        return samples.T
    return samples


class _Run:
    def __init__(self, llm, language, task, strategy, timestamps, batch_size, progress, beam_size=1,
                 options: DecodeOptions = DecodeOptions()):
        self.llm = llm
        self.tokens, fe, self.max_positions = engine_whisper_info(llm)
        self.sample_rate = fe.sampling_rate
        self.window_samples = int(round(WINDOW_S * self.sample_rate))
        self.overlap_samples = int(round(CHUNK_OVERLAP_S * self.sample_rate))
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not valid; valid: {', '.join(STRATEGIES)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(beam_size, int) or beam_size < 1:
            raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
        self.beam_size = beam_size
        self.tokens.check_task(task)
        if timestamps and not self.tokens.has_timestamps:
            raise ValueError("this checkpoint's vocabulary has no timestamp tokens; transcribe without timestamps")
        if llm.tokenizer is None:
            raise ValueError("transcribe needs the checkpoint's tokenizer (tokenizer.json) to decode text; "
                             "this model has none")
        self.language = self.tokens.language_code(language) if language else (
            None if self.tokens.is_multilingual else "en")
        if self.language is None and not self.tokens.languages:
            raise ValueError("cannot detect the language: the generation config has no lang_to_id; "
                             "pass a language (e.g. 'en')")
        self.task, self.strategy, self.timestamps = task, strategy, timestamps
        self.progress = progress
        self.request_slots = asyncio.Semaphore(batch_size)
        # Requests are made (audio padded, prompts checked) on one thread of their own, off the event
        # loop, with no torch work: the runner computes the features on the engine thread, as a
        # thread that runs torch's CPU ops keeps an OpenMP pool, and more pools than cores make the
        # engine thread's workers sleep between parallel regions (cpu_threads.py).
        self.submitter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="enc2dec-submit")
        self.file_slots = asyncio.Semaphore(batch_size)
        self._advanced: dict[int, float] = {}      # id(Transcript) -> audio seconds reported so far
        self._rules: dict[tuple, tuple[list, int]] = {}
        self._set_decoding(options)
        self.aligner = None           # a WordAligner when word timestamps are asked

    # ---- one file --------------------------------------------------------------------------
    async def file(self, name: str, source, duration: float | AudioError) -> Transcript:
        if isinstance(duration, AudioError):
            return self._done(Transcript(name, error=str(duration)), 0.0)
        async with self.file_slots:
            try:
                wave = await asyncio.to_thread(self._load, source)
            except AudioError as e:
                return self._done(Transcript(name, error=str(e)), duration)
            t = Transcript(name, language=self.language, duration_s=len(wave) / self.sample_rate)
            try:
                # vad on one window would only cut its silence out: the whole window decodes as
                # transformers' short-form generate does (chunked's plan is that one window).
                decode = self._chunked if self.strategy == "vad" and len(wave) <= self.window_samples else \
                    {"sequential": self._sequential, "chunked": self._chunked, "vad": self._vad}[self.strategy]
                raw = await decode(wave, t)
            except (_DecodeError, ValueError) as e:
                t.error = f"decoding failed: {e}"
                return self._done(t, duration)
            finally:
                self._started.discard(id(t))
            pieces = monotonic(raw, t.duration_s)
            stats = [p.stats or WindowStats() for p in pieces]
            t.text = self._text([tok for p in pieces for tok in p.token_ids])
            if self.aligner is not None:
                texts = [self._text(p.token_ids) for p in pieces]
                try:
                    aligned = await self.aligner.segments(wave, pieces, texts, t.language)
                except RuntimeError as e:
                    t.error = f"word alignment failed: {e}"
                else:
                    # one aligned segment per piece with text, in order: the window stats follow
                    kept = [st for st, text in zip(stats, texts) if text]
                    t.segments = [s._replace(avg_logprob=round(st.avg_logprob, 4),
                                             compression_ratio=round(st.compression_ratio, 4),
                                             no_speech_prob=round(st.no_speech_prob, 4), temperature=st.temperature)
                                  for s, st in zip(aligned, kept)]
            elif self.timestamps:
                t.segments = [Segment(round(p.start_s, 3), round(p.end_s, 3), text, round(st.avg_logprob, 4),
                                      round(st.compression_ratio, 4), round(st.no_speech_prob, 4), st.temperature)
                              for p, st in zip(pieces, stats) if (text := self._text(p.token_ids))]
            return self._done(t, duration)

    def _done(self, t: Transcript, duration: float) -> Transcript:
        # A failed or cut-short file still moves the bar to its full length.
        self.progress.advance(max(0.0, duration - self._advanced.pop(id(t), 0.0)))
        self.progress.file_done(t)
        return t

    def _advance(self, t: Transcript, seconds: float) -> None:
        self._advanced[id(t)] = self._advanced.get(id(t), 0.0) + seconds
        self.progress.advance(seconds)

    def _load(self, source) -> np.ndarray:
        if isinstance(source, tuple):
            wave = resample(to_mono(_frames_first(np.asarray(source[0]))), int(source[1]), self.sample_rate)
            if wave.size == 0:
                raise AudioError("the audio array is empty")
            return wave
        return load_audio(str(source), self.sample_rate)

    def _text(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(self.tokens.text_ids(ids), skip_special_tokens=True).strip()

    # ---- strategies ------------------------------------------------------------------------
    async def _sequential(self, wave: np.ndarray, t: Transcript):
        # One short window without timestamps decodes exactly as transformers' short-form
        # generate; anything longer seeks by timestamps.
        use_ts = self.timestamps or len(wave) > self.window_samples
        seek, pieces = 0, []
        previous = list(self.initial_prompt_ids)      # the text the next window is prompted with
        while len(wave) - seek >= MIN_WINDOW_S * self.sample_rate or seek == 0:
            window = wave[seek:seek + self.window_samples]
            ids = await self._decode(window, t, use_ts, previous_ids=previous)
            start_s, length_s = seek / self.sample_rate, len(window) / self.sample_rate
            result = parse_window(ids, self.tokens.eot, self.tokens.timestamp_begin, start_s, length_s, use_ts,
                                  ids.stats)
            kept = closed_pieces(result, start_s) if use_ts else result.pieces
            pieces += kept
            if self.options.condition_on_previous_text:
                done = kept_tokens(ids, self.tokens.eot, self.tokens.timestamp_begin,
                                   not use_ts or result.consumed_s >= length_s)
                previous = next_previous_ids(previous, done, ids.stats)
            else:
                previous = []
            step = max(1, int(round(result.consumed_s * self.sample_rate)))
            self._advance(t, min(step, len(wave) - seek) / self.sample_rate)
            seek += step
        return pieces

    async def _chunked(self, wave: np.ndarray, t: Transcript):
        sr = self.sample_rate
        spans = chunk_windows(wave, sr)
        starts, ends = [s for s, _ in spans], [e for _, e in spans]
        windows = [wave[s:e] for s, e in spans]
        # Several windows decode with timestamp tokens even when no times are asked for: without
        # them Whisper often ends a full 30 s window early and drops whole sentences.
        use_ts = self.timestamps or len(windows) > 1
        new_audio_s = [(ends[i] - (ends[i - 1] if i else 0)) / sr for i in range(len(ends))]
        # Only window i hears the audio up to where window i + 1 starts; a retry runs into the next
        # window by the usual overlap, so the two stitch like neighbours.
        only_mine = starts[1:] + [len(wave)]
        retry_from: list[float | None] = [None] * len(windows)
        retry_end = [0] * len(windows)

        async def parse_and_retry(i: int, ids) -> tuple[list[Piece], list[Piece] | None]:
            pieces = parse_window(ids, self.tokens.eot, self.tokens.timestamp_begin, starts[i] / sr,
                                  len(windows[i]) / sr, use_ts, ids.stats).pieces
            r = retry_from[i] = unheard_from(pieces, only_mine[i] / sr) if use_ts else None
            if r is None:
                return pieces, None
            retry_end[i] = min(int(r * sr) + self.window_samples, only_mine[i] + self.overlap_samples, len(wave))
            return pieces, await self._retry_one(wave[int(r * sr):retry_end[i]], r, t)

        # A chunk after the first starts mid-speech: its first words may come late.
        results = await self._decode_windows(windows, t, use_ts, new_audio_s, [i == 0 for i in range(len(windows))],
                                             then=parse_and_retry)
        parsed, retried = [p for p, _ in results], [r for _, r in results]
        merged, heard_until = Merged(), 0.0
        for i, pieces in enumerate(parsed):
            start_s = starts[i] / sr
            merge_chunk(merged, pieces, (start_s, max(heard_until, start_s)))
            heard_until = ends[i] / sr
            if retried[i] is not None:
                merge_chunk(merged, retried[i], (retry_from[i], heard_until))
                heard_until = max(heard_until, retry_end[i] / sr)
        return merged_pieces(merged)

    async def _vad(self, wave: np.ndarray, t: Transcript):
        sr = self.sample_rate
        regions = await asyncio.to_thread(speech_regions, wave, sr, WINDOW_S)
        plan = pack_windows(regions, self.window_samples)
        if not plan:
            return []           # no speech: nothing to decode, nothing to invent
        windows = [w.audio(wave) for w in plan]
        use_ts = self.timestamps or len(wave) > self.window_samples
        heard = [w.regions[-1][1] for w in plan]
        new_audio_s = [(heard[i] - (heard[i - 1] if i else 0)) / sr for i in range(len(plan))]

        async def parse_and_retry(i: int, ids) -> tuple[list[Piece], list[Piece] | None]:
            audio = windows[i]
            pieces = parse_window(ids, self.tokens.eot, self.tokens.timestamp_begin, 0.0, len(audio) / sr, use_ts,
                                  ids.stats).pieces
            r = unheard_from(pieces, len(audio) / sr) if use_ts else None
            return pieces, None if r is None else await self._retry_one(audio[int(r * sr):], r, t)

        # Every window opens at a speech onset (plus the pad), so its first timestamp comes early.
        # And its speech runs to its end: Whisper may not close it while more than RETRY_GAP_S of it
        # is unheard (it otherwise does, dropping the rest: 3-5 windows in 10 on the files of docs/transcribe.md).
        ends = [self.tokens.timestamp_at(len(w) / sr - RETRY_GAP_S) if use_ts else None for w in windows]
        results = await self._decode_windows(windows, t, use_ts, new_audio_s, [True] * len(plan), then=parse_and_retry,
                                             end_not_before=ends)
        parsed, retried = [p for p, _ in results], [r for _, r in results]
        pieces = []
        for w, window_pieces, extra in zip(plan, parsed, retried):
            pieces += [Piece(*w.span_to_file_s(p.start_s, p.end_s, sr), p.token_ids, p.stats)
                       for p in window_pieces + (extra or [])]
        return pieces

    async def _retry_one(self, audio: np.ndarray, start_s: float, t: Transcript) -> list[Piece]:
        """The pieces of ``audio`` (starting ``start_s`` into the file or window) decoded once more
        with timestamps; its audio was already counted in the progress."""
        ids = await self._decode(audio, t, True)
        return parse_window(ids, self.tokens.eot, self.tokens.timestamp_begin, start_s, len(audio) / self.sample_rate,
                            True, ids.stats).pieces

    async def _decode_windows(self, windows: list[np.ndarray], t: Transcript, use_ts: bool,
                              new_audio_s: list[float], cap_first_timestamp: list[bool], then=None,
                              end_not_before: list[int | None] | None = None) -> list:
        """Every window's output, all in flight at once (with ``then``, ``await then(i, output)``
        instead: run as soon as window i is done, so a retry it submits joins the engine's batch
        while the other windows still decode, not in a second wave after all of them). Without a
        language on a multilingual checkpoint, the other windows wait for the first one's language
        token, not its whole text."""
        async def one(i: int, language_known: asyncio.Future | None = None, audio_key: str | None = None):
            ids = await self._decode(windows[i], t, use_ts, language_known, cap_first_timestamp[i],
                                     end_not_before=end_not_before[i] if end_not_before else None,
                                     audio_key=audio_key)
            self._advance(t, new_audio_s[i])
            return ids if then is None else await then(i, ids)

        language_known = asyncio.get_running_loop().create_future() if t.language is None else None
        first_key = None
        if language_known is not None and len(windows) > 1 and self.beam_size > 1 \
                and self.options.temperatures[0] == 0:
            # Beams stream nothing until they end, so the other windows would wait for the first
            # one's whole decode (one window in flight: beam 5 took 3.7x greedy's steps). Detect the
            # language in one greedy step first, as faster-whisper and the original do; the first
            # window then decodes from that request's cross K/V, without a second encoder pass.
            first_key = f"enc2dec-window-{uuid.uuid4().hex}"
            await self._detect_language(windows[0], t, use_ts, first_key)
            language_known = None
        first = asyncio.ensure_future(one(0, language_known, first_key))
        rest: list[asyncio.Future] = []
        try:
            if language_known is not None and len(windows) > 1:
                await asyncio.wait([first, language_known], return_when=asyncio.FIRST_COMPLETED)
                if first.done():
                    first.result()          # raises the first window's failure
            rest = [asyncio.ensure_future(one(i)) for i in range(1, len(windows))]
            return [await first] + list(await asyncio.gather(*rest))
        except BaseException:
            for f in [first, *rest]:
                f.cancel()
            raise

    # ---- one window = one engine request ----------------------------------------------------
    def _processors(self, detect: bool, use_ts: bool, cap_first_timestamp: bool,
                    open_segment_at: int | None = None, end_not_before: int | None = None) -> tuple[list, int]:
        """The logits rules of a window, and how many forced tokens precede its text. Shared by
        every window of the run: they hold no per-request state."""
        key = (detect, use_ts, cap_first_timestamp, open_segment_at, end_not_before)
        if key not in self._rules:
            self._rules[key] = decoding_rules(
                self.tokens, detect_language=detect, timestamps=use_ts, task=self.task,
                max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX if cap_first_timestamp else None,
                open_segment_at=open_segment_at, end_not_before=end_not_before)
        return self._rules[key]

    def _set_decoding(self, o: DecodeOptions) -> None:
        """The decoding options' token ids, looked up once per run."""
        self.options = o
        tok = self.llm.tokenizer
        self.start_of_prev = _special_id(tok, "<|startofprev|>")
        self.no_speech = _special_id(tok, "<|nospeech|>", "<|nocaptions|>")
        if (o.condition_on_previous_text or o.initial_prompt or o.hotwords) and self.start_of_prev is None:
            raise ValueError("this checkpoint's vocabulary has no <|startofprev|>: it cannot be prompted with "
                             "previous text, an initial prompt or hotwords")
        if o.condition_on_previous_text and self.strategy != "sequential":
            raise ValueError("condition_on_previous_text needs strategy 'sequential' (windows decoded side by side "
                             "have no previous text)")
        if o.prefix and self.language is None:
            raise ValueError("prefix needs the language (pass language=...): the first window's language is "
                             "otherwise detected where the prefix would go")
        self.initial_prompt_ids = self._encode("initial_prompt", o.initial_prompt)
        self.hotword_ids = self._encode("hotwords", o.hotwords)
        self.prefix_ids = self._encode("prefix", o.prefix)[:MAX_PROMPT_TOKENS]     # faster-whisper's bound
        self._started: set[int] = set()             # id(Transcript) of files whose first window began

    def _encode(self, name: str, text: str | None) -> list[int]:
        if not text or not text.strip():
            return []
        try:    # a leading space, as the text follows other text in the decoder (the original's)
            return list(self.llm.tokenizer.encode(" " + text.strip(), add_special_tokens=False))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    async def _decode(self, window: np.ndarray, t: Transcript, use_ts: bool,
                      language_known: asyncio.Future | None = None, cap_first_timestamp: bool = True,
                      previous_ids: list[int] | None = None, end_not_before: int | None = None,
                      audio_key: str | None = None) -> "WindowTokens":
        """The window's output ids after the forced tokens, with its stats; empty when it is
        judged silence. ``previous_ids``: the text to prompt with (None: the initial prompt, as
        windows decoded side by side have no previous text). Each temperature tried is one
        engine request. A file's first call decodes its first window (strategies start it first)."""
        o = self.options
        first = id(t) not in self._started
        self._started.add(id(t))
        prefix_ids = self.prefix_ids if first else []
        # With timestamps the prefix opens the first segment at <|0.00|>.
        forced = ([self.tokens.timestamp_begin] if use_ts and prefix_ids else []) + prefix_ids
        previous_ids = self.initial_prompt_ids if previous_ids is None else previous_ids
        hot = [] if prefix_ids else self.hotword_ids          # faster-whisper's: hotwords when no prefix
        prompt = prompt_tokens(self.start_of_prev, hot, previous_ids) if self.start_of_prev is not None else []
        # A retry decodes the same audio: under one key the engine keeps the first attempt's cross
        # K/V and the retry skips the encoder.
        if audio_key is None and len(o.temperatures) > 1:
            audio_key = f"enc2dec-window-{uuid.uuid4().hex}"
        for attempt, temperature in enumerate(o.temperatures, start=1):
            ids, stats = await self._attempt(window, t, use_ts, language_known, cap_first_timestamp, prompt,
                                             forced, temperature, audio_key, end_not_before)
            stats = dataclasses.replace(stats, num_attempts=attempt)
            if not needs_fallback(stats, o):
                break
        if is_no_speech(stats, o):
            return WindowTokens([], stats)
        return WindowTokens(forced + ids, stats)

    async def _detect_language(self, window: np.ndarray, t: Transcript, use_ts: bool, audio_key: str) -> None:
        """Set ``t.language`` from one greedy step over ``window`` (the likeliest language token),
        under ``audio_key`` so that the window's own request reuses its cross K/V."""
        tok = self.tokens
        prompt = prompt_tokens(self.start_of_prev, self.hotword_ids, self.initial_prompt_ids) \
            if self.start_of_prev is not None else []
        processors, _ = self._processors(True, use_ts, True)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logits_processors=processors)
        request = {"prompt_token_ids": prompt + tok.prefix(None, self.task, use_ts),
                   "multi_modal_data": {"audio": [(window, self.sample_rate)]},
                   "multi_modal_uuids": {"audio": [audio_key]}}
        async with self.request_slots:
            handle = await asyncio.get_running_loop().run_in_executor(
                self.submitter, functools.partial(self.llm.generate_async, request, params))
            try:
                final = await handle
            except asyncio.CancelledError:
                handle.abort()
                raise
        ids = final.outputs[0].token_ids if final.outputs else []
        if final.error or not ids:
            raise _DecodeError(final.error or "language detection gave no token")
        t.language = next(c for c, i in tok.languages.items() if i == ids[0])

    async def _attempt(self, window, t, use_ts, language_known, cap_first_timestamp, prompt, forced,
                       temperature, audio_key: str | None = None,
                       end_not_before: int | None = None) -> tuple[list[int], WindowStats]:
        tok = self.tokens
        detect = t.language is None
        decoder_prompt = prompt + tok.prefix(t.language, self.task, use_ts) + forced
        processors, begin = self._processors(detect, use_ts, cap_first_timestamp,
                                             tok.timestamp_begin if use_ts and forced else None, end_not_before)
        beam = temperature == 0 and self.beam_size > 1
        sampled = temperature > 0
        params = SamplingParams(
            max_tokens=min(MAX_WINDOW_TOKENS + begin, self.max_positions - len(decoder_prompt)),
            temperature=temperature, seed=0 if sampled else None, n=self.options.best_of if sampled else 1,
            detokenize=False, logits_processors=processors or None, use_beam_search=beam,
            best_of=self.beam_size if beam else None, logprobs=0,
            prefix_logprob_token_ids=[self.no_speech] if self.no_speech is not None else None,
            prefix_logprob_position=len(prompt))        # right after <|startoftranscript|>
        request = {"prompt_token_ids": decoder_prompt, "multi_modal_data": {"audio": [(window, self.sample_rate)]}}
        if audio_key is not None:
            request["multi_modal_uuids"] = {"audio": [audio_key]}
        async with self.request_slots:
            handle = await asyncio.get_running_loop().run_in_executor(
                self.submitter, functools.partial(self.llm.generate_async, request, params, streaming=detect))
            try:
                final = None
                async for final in handle:
                    ids = final.outputs[0].token_ids
                    if detect and ids and t.language is None:
                        t.language = next(c for c, i in tok.languages.items() if i == ids[0])
                        if language_known is not None and not language_known.done():
                            language_known.set_result(t.language)
            except asyncio.CancelledError:
                handle.abort()
                raise
        if final is None or final.error or any(c.finish_reason == "abort" for c in final.outputs):
            raise _DecodeError((final.error if final is not None else None) or "the engine aborted the request")
        t.num_windows += 1
        t.num_tokens += sum(len(c.token_ids) for c in final.outputs)
        scored = [(c.token_ids[begin:], [lp[i] for i, lp in zip(c.token_ids[begin:], (c.logprobs or [])[begin:])])
                  for c in final.outputs]
        # The original's token count: everything before the end token, timestamps included.
        ids, lps = scored[best_sample([([i for i in ids if i != tok.eot], sum(lps)) for ids, lps in scored])]
        text_ids = [i for i in ids if i != tok.eot]
        lp_ns = (final.outputs[0].prefix_logprobs or {}).get(self.no_speech)
        return ids, WindowStats(temperature, avg_logprob(lps, len(text_ids)),
                                compression_ratio(self._text(ids)), math.exp(lp_ns) if lp_ns is not None else 0.0)


class WindowTokens(list):
    """A window's output ids (a plain list to the strategies) and what its decode measured."""

    def __init__(self, ids: list[int], stats: WindowStats):
        super().__init__(ids)
        self.stats = stats


def _special_id(tokenizer, *names: str) -> int | None:
    """The first of ``names`` the tokenizer knows (None: none of them, or no tokenizer)."""
    for name in names:
        i = tokenizer.convert_tokens_to_ids(name) if tokenizer is not None else None
        if i is not None and i != getattr(tokenizer, "unk_token_id", None):
            return int(i)
    return None
