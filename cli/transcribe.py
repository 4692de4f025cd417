"""``enc2dec transcribe``: audio files of any length, format and rate to text and subtitles.

A thin command: options in, ``enc2dec.engine.whisper.transcribe.transcribe`` does the work, files
and a summary out. Exit codes: 0 every file transcribed, 1 some file failed (each gets its
own error line; the rest still finish), 2 bad usage or input (unknown option value, a path
that does not exist, a model that cannot be loaded).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Optional

import typer

from enc2dec.cli.common import DP_SIZE_FLAGS, DP_SIZE_HELP, OptStr, option

HELP = """Transcribe (or translate to English) audio files with Whisper.

Inputs are files or folders (searched recursively) in any format that
libsndfile reads (wav, flac, ogg, opus, mp3), at any sampling rate and
channel count, of any length. A file of at most 30 s decodes as one
window. Longer ones: --strategy vad (default, the most accurate on our
long-form measurements) decodes only the speech Silero VAD finds, packed
into 30 s windows decoded together (silence gives no text). --strategy
chunked decodes overlapping 30 s windows together and stitches them (no
VAD). --strategy sequential moves a 30 s window along the timestamps the
model predicts, as the original Whisper does (one window at a time per
file). See docs/transcribe.md. Text goes to stdout unless --output-dir is given;
progress and the summary go to stderr. Exit codes: 0 all files done,
1 some file failed, 2 bad usage or input.

Examples:

  enc2dec transcribe talk.mp3

  # subtitles for a folder, language given, two formats
  enc2dec transcribe recordings/ --language de -f srt,vtt -o subs/

  # a long recording without Silero VAD: overlapping windows, stitched
  enc2dec transcribe meeting.flac --strategy chunked

  # translate into English, segment times on stdout
  enc2dec transcribe interview.flac --task translate --timestamps

  # the original Whisper's decoding: fallback, previous text, a spelling hint
  enc2dec transcribe book.flac --strategy sequential
    --temperature 0,0.2,0.4,0.6,0.8,1.0 --condition-on-previous-text
    --initial-prompt 'Mr. Dashwood, Norland Park.'
  # per-word start, end and probability in json; karaoke-style srt
  enc2dec transcribe talk.mp3 --word-timestamps -f json,srt -o out/
  enc2dec transcribe talk.mp3 --subtitle-words -f srt

  # a local checkpoint and an engine config (TensorRT-LLM YAML shape)
  enc2dec transcribe clip.wav --model ./whisper-base
    --config enc-dec-config.yaml

  # timing with random weights, no download (prints token ids)
  enc2dec transcribe long.wav --model openai/whisper-large-v3
    --load-format dummy --language en
"""

DEFAULT_MODEL = "openai/whisper-large-v3"


D, O, E = "Decoding", "Output", "Engine"


class _UsageError(ValueError):
    pass


def transcribe(
    inputs: Annotated[list[str], typer.Argument(help="Audio files and/or folders.", show_default=False)],
    model: Annotated[str, option("Hugging Face folder or hub id of a Whisper checkpoint (with --load-format "
                               "dummy also a known name).", E)] = DEFAULT_MODEL,
    language: Annotated[OptStr, option("Spoken language, a code or a name (en, de, 'german'); default: "
                                     "detected per file on multilingual checkpoints.", D)] = None,
    task: Annotated[str, option("transcribe, or translate (into English).", D)] = "transcribe",
    strategy: Annotated[str, option("Audio over 30 s: vad (speech regions from Silero VAD packed into 30 s "
                                  "windows decoded together; silence is skipped; needs silero-vad, in the audio "
                                  "extra), chunked (overlapping windows decoded together and stitched) or "
                                  "sequential (seek by predicted timestamps, one window at a time). E.g. "
                                  "--strategy chunked.", D)] = "vad",
    timestamps: Annotated[bool, option("Segment start and end times in the txt output (srt, vtt, tsv and json "
                                     "always carry them).", D)] = False,
    word_timestamps: Annotated[bool, option("Per-word start, end and probability (json: a words list in each "
                                          "segment), from the model's alignment heads; e.g. --word-timestamps "
                                          "-f json. Costs one more encoder and decoder pass per window.", D)] = False,
    subtitle_words: Annotated[bool, option("srt / vtt: one cue per word instead of one per segment (implies "
                                         "--word-timestamps), e.g. --subtitle-words -f srt.", O)] = False,
    beam_size: Annotated[int, option("Beam width: 1 decodes greedily, K > 1 keeps K beams per window (the "
                                   "best hypothesis wins; slower).", D)] = 1,
    batch_size: Annotated[int, option("30 s windows decoding at once, across all files.", D)] = 32,
    temperature: Annotated[str, option("A temperature, or a comma list to fall back through: a window whose "
                                     "text fails --compression-ratio-threshold or --logprob-threshold decodes "
                                     "again at the next one (--best-of samples), e.g. 0,0.2,0.4,0.6,0.8,1.0 "
                                     "(the original Whisper's).", D)] = "0",
    compression_ratio_threshold: Annotated[str, option("Fall back when the gzip compression ratio of a "
                                                     "window's text is above this (repeated text); 'none' is off.",
                                                     D)] = "2.4",
    logprob_threshold: Annotated[str, option("Fall back when a window's mean token log-probability is below "
                                           "this; 'none' is off.", D)] = "-1.0",
    no_speech_threshold: Annotated[str, option("Skip a window whose <|nospeech|> probability is above this while "
                                             "its mean log-probability is below --logprob-threshold; 'none' is "
                                             "off.", D)] = "0.6",
    best_of: Annotated[int, option("Samples per window at a temperature above 0 (the likeliest is kept).", D)] = 5,
    condition_on_previous_text: Annotated[bool, option("Prompt each window with the text before it "
                                                     "(--strategy sequential; reset after a window decoded above "
                                                     "temperature 0.5).", D)] = False,
    initial_prompt: Annotated[OptStr, option("Text the first window is prompted with (every window with "
                                           "--strategy vad or chunked): spellings, names, style, e.g. 'Mr. Dashwood, "
                                           "Norland Park.'", D)] = None,
    hotwords: Annotated[OptStr, option("Words to prompt every window with (faster-whisper's hotwords), e.g. "
                                     "'Dashwood Norland'.", D)] = None,
    prefix: Annotated[OptStr, option("Text the transcript of each file starts with (forced after the task "
                                   "tokens of its first window), e.g. 'And Mr. John'.", D)] = None,
    output_format: Annotated[str, option("txt, srt, vtt, json, tsv, a comma list of them, or all (all and lists "
                                       "need --output-dir).", O, "--output-format", "-f")] = "txt",
    output_dir: Annotated[OptStr, option("Write one file per input and format here (default: the text to "
                                       "stdout).", O, "--output-dir", "-o")] = None,
    quiet: Annotated[bool, option("No progress bar, no per-file language lines; errors and the summary "
                                "still go to stderr.", O)] = False,
    config: Annotated[OptStr, option("Engine YAML (LLM option names, e.g. enc-dec-config.yaml); the options "
                                   "below win.", E)] = None,
    load_format: Annotated[OptStr, option("auto (the checkpoint's weights) or dummy (random, for timing).", E)] = None,
    dtype: Annotated[OptStr, option("auto, float32, float16 or bfloat16.", E)] = None,
    device: Annotated[OptStr, option("auto, cpu, cuda or cuda:N.", E)] = None,
    tp_size: Annotated[Optional[int], option("Tensor-parallel GPUs (tensor_parallel_size); the attention head "
                                           "counts must divide by it.", E, "--tp-size", "--tp_size")] = None,
    dp_size: Annotated[Optional[int], option(DP_SIZE_HELP + " --batch-size windows decode at once on each "
                                             "replica.", E, *DP_SIZE_FLAGS)] = None,
    ray_address: Annotated[OptStr, option("Transcribe on a Ray cluster through Ray Data: auto (the cluster on this "
                                        "machine), local (start one here), or an address such as "
                                        "ray://head:10001. Files must be readable at the same path on every "
                                        "node. Needs the ray extra.", E)] = None,
    ray_actors: Annotated[int, option("With --ray-address: engines (Ray actors) transcribing side by side, "
                                    "each on --tp-size GPUs.", E)] = 1,
) -> None:
    options = dict(locals())
    from .common import run_command

    run_command("transcribe", lambda: _run(options), (_UsageError,))


def _formats(text: str, output_dir: str | None) -> list[str]:
    from enc2dec.engine.whisper.subtitles import FORMATS

    names = list(FORMATS) if text.strip() == "all" else [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in FORMATS]
    if bad or not names:
        raise _UsageError(f"--output-format {text!r} is not valid; valid: {', '.join(FORMATS)}, all "
                          "(or a comma list)")
    if len(names) > 1 and not output_dir:
        raise _UsageError(f"--output-format {text} writes several files: give --output-dir")
    return list(dict.fromkeys(names))


def _check_options(o: dict) -> tuple[list[str], list[str]]:
    from enc2dec.engine.whisper.audio import expand_inputs
    from enc2dec.engine.whisper.transcribe import STRATEGIES, TASKS

    if o["beam_size"] < 1:
        raise _UsageError(f"--beam-size must be >= 1, got {o['beam_size']}")
    if o["strategy"] not in STRATEGIES:
        raise _UsageError(f"--strategy {o['strategy']!r} is not valid; valid: {', '.join(STRATEGIES)}")
    if o["task"] not in TASKS:
        raise _UsageError(f"--task {o['task']!r} is not valid; valid: {', '.join(TASKS)}")
    if o["batch_size"] < 1:
        raise _UsageError(f"--batch-size must be >= 1, got {o['batch_size']}")
    if o["ray_actors"] < 1:
        raise _UsageError(f"--ray-actors must be >= 1, got {o['ray_actors']}")
    o["decode"] = _decode_options(o)
    formats = _formats(o["output_format"], o["output_dir"])
    if o["subtitle_words"] and not any(f in ("srt", "vtt") for f in formats):
        raise _UsageError(f"--subtitle-words applies to srt and vtt output, not {','.join(formats)}: "
                          "add -f srt or -f vtt")
    files, problems = expand_inputs(o["inputs"])
    if problems:
        raise _UsageError("; ".join(problems))
    if o["strategy"] == "vad":
        _check_vad(files)
    return files, formats


def _check_vad(files: list[str]) -> None:
    """Silero VAD is needed only for files over 30 s: known from their headers before the model
    loads, so a missing extra costs neither the load nor any decoded window."""
    from enc2dec.engine.whisper.audio import AudioError, probe_duration_s
    from enc2dec.engine.whisper.longform import WINDOW_S
    from enc2dec.engine.whisper.vad import INSTALL_COMMAND, check_available

    def is_long(path: str) -> bool:
        try:
            return probe_duration_s(path) > WINDOW_S
        except AudioError:          # reported per file later; the others still run
            return False

    try:
        check_available()
    except ValueError:
        long_files = [f for f in files if is_long(f)]
        if long_files:
            raise _UsageError(f"--strategy vad (the default for audio over 30 s, here {len(long_files)} file(s), "
                              f"e.g. {long_files[0]}) needs silero-vad and onnxruntime: {INSTALL_COMMAND}, or "
                              "pass --strategy chunked or --strategy sequential") from None


def _number(name: str, text: str, none_ok: bool = True) -> float | None:
    if none_ok and text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise _UsageError(f"--{name} must be a number{' or none' if none_ok else ''}, got {text!r}") from None


def _decode_options(o: dict) -> dict:
    """The original Whisper's decoding options as transcribe() keywords, validated here so a bad
    value is a usage error before the model loads."""
    from enc2dec.engine.whisper.decoding import DecodeOptions

    temps = tuple(_number("temperature", t, none_ok=False) for t in o["temperature"].split(","))
    kw = dict(temperature=temps,
              compression_ratio_threshold=_number("compression-ratio-threshold", o["compression_ratio_threshold"]),
              logprob_threshold=_number("logprob-threshold", o["logprob_threshold"]),
              no_speech_threshold=_number("no-speech-threshold", o["no_speech_threshold"]), best_of=o["best_of"],
              condition_on_previous_text=o["condition_on_previous_text"], initial_prompt=o["initial_prompt"],
              hotwords=o["hotwords"], prefix=o["prefix"])
    try:
        DecodeOptions(temperatures=kw["temperature"], **{k: v for k, v in kw.items() if k != "temperature"})
    except ValueError as e:
        raise _UsageError("--" + str(e).replace("_", "-")) from None
    if o["condition_on_previous_text"] and o["strategy"] != "sequential":
        raise _UsageError("--condition-on-previous-text needs --strategy sequential (windows decoded side by side "
                          "have no previous text)")
    return kw


def _llm_args(o: dict):
    from enc2dec.engine.launch import build_llm_args
    from enc2dec.engine.whisper.tokens import with_stand_in_tokenizer

    try:
        args = build_llm_args(o["model"], o["config"], load_format=o["load_format"], dtype=o["dtype"],
                              device=o["device"], tensor_parallel_size=o["tp_size"],
                              data_parallel_size=o["dp_size"])
        if args.max_beam_width < o["beam_size"]:      # reserve the beams --beam-size asks for
            args = dataclasses.replace(args, max_beam_width=o["beam_size"])
    except ValueError as e:
        raise _UsageError(f"engine config: {e}") from None
    return with_stand_in_tokenizer(args)      # dummy weights: prefixes as special-token strings


def _run(o: dict) -> int:
    files, formats = _check_options(o)
    args = _llm_args(o)
    if o["ray_address"] and args.data_parallel_size > 1:
        raise _UsageError("--dp-size with --ray-address: Ray Data runs the engines there (--ray-actors); use one "
                          "or the other")
    if o["ray_address"]:
        results, wall_s, load_s = _transcribe_on_ray(o, args, files, formats)
    else:
        results, wall_s, load_s = _transcribe_here(o, args, files, formats)
    return _write(o, args, files, formats, results, wall_s, load_s)


def _transcribe_here(o: dict, args, files: list[str], formats: list[str]):
    from enc2dec.engine.launch import start_llm
    from enc2dec.engine.whisper.subtitles import TIMED_FORMATS
    from enc2dec.engine.whisper.tokens import engine_whisper_info
    from enc2dec.engine.whisper.transcribe import transcribe as run_transcribe

    from .transcribe_progress import make_progress

    progress = make_progress(quiet=o["quiet"])
    try:
        t0 = time.perf_counter()
        if o["strategy"] == "vad":
            from enc2dec.engine.whisper.vad import preload_in_background

            preload_in_background()          # beside the checkpoint's load, not in the first file's time
        try:
            with progress.status(f"loading {args.model}"):
                llm = start_llm(args)
        except ValueError as e:
            raise _UsageError(str(e)) from None
        load_s = time.perf_counter() - t0
        with llm:
            try:
                tokens = engine_whisper_info(llm)[0]
                progress.report_language = o["language"] is None and tokens.is_multilingual
                # srt, vtt and tsv need segment times; json carries them when the checkpoint can.
                timed = any(f in TIMED_FORMATS for f in formats if f != "json") or (
                    "json" in formats and tokens.has_timestamps)
                t1 = time.perf_counter()
                results = run_transcribe(llm, files, language=o["language"], task=o["task"],
                                         strategy=o["strategy"], timestamps=o["timestamps"] or timed,
                                         batch_size=o["batch_size"] * args.data_parallel_size, progress=progress,
                                         beam_size=o["beam_size"], **o["decode"],
                                         word_timestamps=o["word_timestamps"] or o["subtitle_words"])
                wall_s = time.perf_counter() - t1
            except ValueError as e:         # options the checkpoint cannot honour, a non-Whisper model
                raise _UsageError(str(e)) from None
    finally:
        progress.stop()
    return results, wall_s, load_s


def _transcribe_on_ray(o: dict, args, files: list[str], formats: list[str]):
    """The same transcripts from ``--ray-actors`` engines on a Ray cluster (the load is inside the
    wall time there: the actors load their engines while the first files wait)."""
    from enc2dec.engine.ray_cluster import connect
    from enc2dec.engine.whisper.ray_data import transcribe_files
    from enc2dec.engine.whisper.subtitles import TIMED_FORMATS

    connect(o["ray_address"], num_cpus=o["ray_actors"] + 1 if o["ray_address"] == "local" else None)
    timed = any(f in TIMED_FORMATS for f in formats if f != "json")
    t0 = time.perf_counter()
    try:
        results = transcribe_files(files, args, concurrency=o["ray_actors"], language=o["language"],
                                   task=o["task"], strategy=o["strategy"],
                                   timestamps=True if o["timestamps"] or timed else ("auto" if "json" in formats
                                                                                   else False),
                                   batch_size=o["batch_size"], beam_size=o["beam_size"], **o["decode"],
                                   word_timestamps=o["word_timestamps"] or o["subtitle_words"])
    except ValueError as e:
        raise _UsageError(str(e)) from None
    return results, time.perf_counter() - t0, 0.0


def _write(o: dict, args, files: list[str], formats: list[str], results, wall_s: float, load_s: float) -> int:
    from enc2dec.engine.whisper.subtitles import output_stems, render, write_outputs

    stems = output_stems([t.source for t in results])
    ok = [t for t in results if t.error is None]
    for t in ok:
        if o["output_dir"]:
            write_outputs(t, formats, o["output_dir"], stems[t.source], words=o["subtitle_words"])
        else:
            if len(files) > 1:
                typer.echo(f"==> {t.source} <==")
            typer.echo(render(t, formats[0], words=o["subtitle_words"]), nl=False)
    for t in results:
        if t.error is not None:
            typer.echo(f"error: {t.error}", err=True)
    audio_s = sum(t.duration_s for t in ok)
    speed = f"{audio_s / wall_s:.1f}x real time" if wall_s > 0 and audio_s > 0 else "no audio"
    failed = len(results) - len(ok)
    loaded = f"{o['ray_actors']} Ray actor(s)" if o["ray_address"] else f"model load {load_s:.1f} s"
    where = f"; wrote {len(ok) * len(formats)} files to {o['output_dir']}" if o["output_dir"] and ok else ""
    typer.echo(f"transcribed {len(ok)} of {len(results)} files{f' ({failed} failed)' if failed else ''}: "
               f"{audio_s:.1f} s of audio in {wall_s:.1f} s, {speed} ({o['strategy']}, {args.model}, "
               f"{loaded}){where}", err=True)
    return 1 if failed else 0


def register(app: typer.Typer) -> None:
    app.command("transcribe", help=HELP, no_args_is_help=True)(transcribe)
