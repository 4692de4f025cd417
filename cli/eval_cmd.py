"""``enc2dec eval``: accuracy on a dataset, and agreement with transformers on the same inputs.

A thin command: options in, ``enc2dec.eval.session.run_eval`` does the work, reports out.
Exit codes: 0 done, 1 a threshold missed (or a request failed), 2 bad usage or data.
"""
from __future__ import annotations

import functools
from typing import Annotated

import typer

from enc2dec.cli.common import (DP_SIZE_FLAGS, DP_SIZE_HELP, OptFloat, OptInt, OptStr, command_line, option,
                                run_command)

HELP = """Score a model on a dataset and against transformers' own outputs.

Tasks: translation (BLEU, chrF), summarization (ROUGE-1/2/L/Lsum), transcription (WER, CER after Whisper's normalizer) and speech-translation (Whisper's translate task; BLEU, chrF).

With --reference hf (the default) transformers generate runs on the same inputs with the same greedy decoding; the report gives both scores, the exact-match rate of output token ids, where outputs first differ and the speedup.

Scores are 0-100; WER, CER and parity are fractions (--max-wer 0.08 is 8 %). Exit codes: 0 done, 1 a threshold missed or a request failed, 2 bad usage or data. Definitions and the JSON schema: docs/eval.md.

Examples:

  # Whisper on a manifest: JSONL of {"audio": file, "text": reference}
  enc2dec eval --task transcription --model openai/whisper-base
    --data clips/manifest.jsonl --max-wer 0.10 --min-parity 1.0

  # T5 on a local JSONL file of {"source": ..., "target": ...}
  enc2dec eval --task translation --model google/flan-t5-small
    --data wmt.jsonl --prefix "translate German to English: "
    --limit 200 --report-json eval.json

  # the task's default dataset (needs 'datasets' and the hub)
  enc2dec eval --task summarization --model facebook/bart-large-cnn
    --limit 100
"""



_data = functools.partial(option, panel="Data")
_engine = functools.partial(option, panel="Engine")
_out = functools.partial(option, panel="Reference, checks and output")


def eval_command(
    ctx: typer.Context,
    task: Annotated[str, typer.Option(help="translation, summarization, transcription or speech-translation.")],
    model: Annotated[str, typer.Option(help="Hugging Face checkpoint folder or hub id.")],
    data: Annotated[OptStr, _data("JSONL / JSON / CSV / Parquet file, audio manifest (JSONL with audio and "
                                  "text, paths relative to it), dataset folder or hub id (default: the "
                                  "task's dataset: wmt16 de-en, cnn_dailymail 3.0.0, librispeech_asr "
                                  "clean).")] = None,
    data_config: Annotated[OptStr, _data("Configuration (subset) of a Hugging Face dataset.")] = None,
    split: Annotated[OptStr, _data("Split of a Hugging Face dataset (default: test).")] = None,
    source_field: Annotated[OptStr, _data("Field holding the input: text, or audio for Whisper; dotted paths "
                                          "reach into objects (translation.de). Default: source / audio.")] = None,
    target_field: Annotated[OptStr, _data("Field holding the reference text (default: target / text).")] = None,
    prefix: Annotated[OptStr, _data("Text put before every source, e.g. 'translate English to German: ' "
                                    "(default: the checkpoint's task prefix if it names one).")] = None,
    language: Annotated[OptStr, _data("Whisper: the spoken language code (default en); required for "
                                      "speech-translation.")] = None,
    limit: Annotated[OptInt, _data("Use the first N rows.")] = None,
    config: Annotated[OptStr, _engine("YAML of engine options (LLM keyword names); command-line options "
                                      "win. kv_cache_config.cross_kv_cache_fraction defaults to 0.5.")] = None,
    dtype: Annotated[OptStr, _engine("auto, float32, float16 or bfloat16 (the reference uses the same).")] = None,
    device: Annotated[OptStr, _engine("auto, cpu, cuda or cuda:N.")] = None,
    tp_size: Annotated[OptInt, typer.Option("--tp-size", "--tp_size", rich_help_panel="Engine",
                                            help="Tensor-parallel GPUs (tensor_parallel_size); the attention "
                                                 "head counts must divide by it.")] = None,
    dp_size: Annotated[OptInt, typer.Option(*DP_SIZE_FLAGS, rich_help_panel="Engine", help=DP_SIZE_HELP)] = None,
    load_format: Annotated[OptStr, _engine("auto, or dummy (random weights; needs --reference none).")] = None,
    max_tokens: Annotated[OptInt, _engine("Most output tokens per row (default 128 text, 224 Whisper).")] = None,
    batch_size: Annotated[OptInt, _engine("transformers' batch size and the engine's max_batch_size "
                                          "(default 16; the engine's from --config when set there).")] = None,
    num_beams: Annotated[int, _engine("Beam width on both sides (1: greedy); the engine returns the best "
                                      "hypothesis, transformers runs generate(num_beams=N).")] = 1,
    reference: Annotated[str, _out("hf: also run transformers generate and compare; none: skip it.")] = "hf",
    warmup: Annotated[int, _out("Untimed warm-up rows on each side before the timed runs.")] = 1,
    min_parity: Annotated[OptFloat, _out("Exit 1 below this exact-match rate of token ids (0-1).")] = None,
    min_bleu: Annotated[OptFloat, _out("Exit 1 below this BLEU (0-100; translation tasks).")] = None,
    max_wer: Annotated[OptFloat, _out("Exit 1 above this WER (a fraction; transcription).")] = None,
    min_rouge: Annotated[OptFloat, _out("Exit 1 below this ROUGE-1 (0-100; summarization).")] = None,
    report_json: Annotated[OptStr, _out("Write every figure and the exact command here.")] = None,
    save_outputs: Annotated[OptStr, _out("Write one JSON line per row: reference, both outputs, ids.")] = None,
    quiet: Annotated[bool, _out("No progress bar.")] = False,
) -> None:
    from enc2dec.eval.errors import EvalInputError

    options = locals()
    run_command("eval", lambda: _run(options), (EvalInputError,))


def _options(o: dict):
    from enc2dec.eval.data import DataSpec
    from enc2dec.eval.options import EvalOptions

    return EvalOptions(
        task=o["task"], model=o["model"],
        data=DataSpec(o["data"], o["data_config"], o["split"], o["source_field"], o["target_field"], o["limit"]),
        prefix=o["prefix"], language=o["language"], max_tokens=o["max_tokens"], batch_size=16 if o["batch_size"] is None else o["batch_size"],
        num_beams=o["num_beams"], reference=o["reference"], warmup=o["warmup"],
        thresholds={k: o[k] for k in ("min_parity", "min_bleu", "max_wer", "min_rouge") if o[k] is not None},
        config=o["config"],
        engine_overrides={"dtype": o["dtype"], "device": o["device"], "load_format": o["load_format"],
                          "max_batch_size": o["batch_size"], "tensor_parallel_size": o["tp_size"],
                          "data_parallel_size": o["dp_size"]},
        report_json=o["report_json"], save_outputs=o["save_outputs"], command=command_line(o["ctx"], "eval"))


def _run(o: dict) -> int:
    from enc2dec.eval import report
    from enc2dec.eval.session import run_eval
    from rich.console import Console

    opts = _options(o)
    opts.validate()
    progress = report.NullProgress() if o["quiet"] else report.RichProgress()
    result = run_eval(opts, progress)
    report.print_summary(result.report, Console())
    if opts.report_json:
        report.write_json(opts.report_json, result.report)
    if opts.save_outputs:
        report.write_outputs(opts.save_outputs, result.rows)
    for f in result.report["engine_failures"]["rows"]:
        typer.echo(f"FAILED: row {f['row']}: {f['error']}", err=True)
    for c in result.checks:
        if not c.passed:
            op = "<=" if c.option.startswith("--max") else ">="
            typer.echo(f"CHECK FAILED: {c.option} {c.limit:g}: {c.figure} = {c.value} (needs {op} {c.limit:g})",
                       err=True)
    return result.exit_code


def register(app: typer.Typer) -> None:
    app.command("eval", help=HELP, no_args_is_help=True)(eval_command)
