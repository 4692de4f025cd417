"""``enc2dec bench``: throughput and latency across concurrency levels, beside transformers.

A thin command: options in, ``enc2dec.bench.session.run_bench`` does the work, reports out.
Exit codes: 0 done, 1 a ``--fail-under`` check missed or a request failed, 2 bad usage or input.
"""
from __future__ import annotations

import functools
from typing import Annotated, Optional

import typer

from enc2dec.cli.common import (DP_SIZE_FLAGS, DP_SIZE_HELP, OptFloat, OptInt, OptStr, command_line, option,
                                run_command)

HELP = """Benchmark a model: closed-loop clients keep C requests in flight at each
concurrency level.

Reports requests/s, output and total tokens/s, TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99), KV-cache use, peak GPU memory and, for Whisper,
the real-time factor. Definitions and the JSON schema: docs/bench.md.
Exit codes: 0 done, 1 a --fail-under check missed or a request failed,
2 bad usage or input.

Examples:

  # no GPU, no hub: random weights, two levels, about a minute on 2 cores
  enc2dec bench --model google/flan-t5-small --load-format dummy
    --concurrency 1,4 --num-requests 8 --input-len 32 --output-len 16

  # GPU, side by side with transformers, JSON for CI, checks
  enc2dec bench --model google/flan-t5-large --load-format dummy
    --dtype bfloat16 --concurrency 1,8,32,64 --baseline hf,hf-compile
    --report-json bench.json --fail-under out_tok_per_s@64=5000
    --fail-under "p99_e2e_ms<=800"

  # Whisper on 30 s synthetic clips, 96 output tokens each
  enc2dec bench --model openai/whisper-large-v3 --load-format dummy
    --audio-seconds 30 --output-len 96 --concurrency 8,64

  # a running OpenAI-compatible server, a trtllm-bench dataset
  enc2dec bench --url http://localhost:8000 --dataset data.jsonl
    --concurrency 8,32

  # a server started just before: bench waits while /health says it is loading
  enc2dec serve google/flan-t5-large --port 8000 &
  enc2dec bench --url http://localhost:8000 --streaming --concurrency 64
"""

def _int_list(text: str, option: str) -> tuple[int, ...]:
    from enc2dec.bench.errors import BenchInputError

    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise BenchInputError(f"{option} {text!r} must be a comma-separated list of integers, e.g. 1,8,32,64") from None
    if not values:
        raise BenchInputError(f"{option} is empty; give e.g. 1,8,32,64")
    return values


def _names(values: list[str] | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for item in values or [] for v in item.split(",") if v.strip()))




_engine = functools.partial(option, panel="Engine")
_work = functools.partial(option, panel="Workload")
_out = functools.partial(option, panel="Output and checks")


def bench(
    ctx: typer.Context,
    model: Annotated[OptStr, _engine("Hugging Face folder or hub id; with --load-format dummy also a known name "
                                     "(google/flan-t5-small, openai/whisper-tiny, ...).")] = None,
    load_format: Annotated[OptStr, _engine("auto (the checkpoint's weights) or dummy (random, no download).")] = None,
    dtype: Annotated[OptStr, _engine("auto, float32, float16 or bfloat16.")] = None,
    device: Annotated[OptStr, _engine("auto, cpu, cuda or cuda:N.")] = None,
    config: Annotated[OptStr, _engine("YAML of engine options (LLM keyword names, e.g. enc-dec-config.yaml); "
                                      "command-line options win.")] = None,
    max_batch_size: Annotated[OptInt, _engine("Most decoder sequences running at once.")] = None,
    max_num_tokens: Annotated[OptInt, _engine("Token budget per engine step.")] = None,
    max_input_len: Annotated[OptInt, _engine("Longest encoder input accepted.")] = None,
    max_seq_len: Annotated[OptInt, _engine("Longest decoder sequence.")] = None,
    encoder_max_batch_size: Annotated[OptInt, _engine("Requests encoded in one step.")] = None,
    attn_backend: Annotated[OptStr, _engine("auto, torch or triton (TRTLLM / VANILLA accepted).")] = None,
    cross_kv_cache_fraction: Annotated[OptFloat, _engine("Share of the KV budget for cross-attention "
                                                         "(default: the config's, else 0.5).")] = None,
    free_gpu_memory_fraction: Annotated[OptFloat, _engine("Share of free GPU memory the KV cache takes.")] = None,
    kv_cache_dtype: Annotated[OptStr, _engine("KV cache dtype: auto (the model's) or fp8 (e4m3 with per-row "
                                              "scales: half of bf16's bytes; kv_cache_config.dtype).")] = None,
    tp_size: Annotated[OptInt, typer.Option("--tp-size", "--tp_size", rich_help_panel="Engine",
                                            help="Tensor-parallel GPUs (tensor_parallel_size); the attention "
                                                 "head counts must divide by it.")] = None,
    dp_size: Annotated[OptInt, typer.Option(*DP_SIZE_FLAGS, rich_help_panel="Engine", help=DP_SIZE_HELP)] = None,
    url: Annotated[OptStr, _engine("Bench a running OpenAI-compatible server (http://host:port) instead of "
                                   "the in-process engine.")] = None,
    ready_timeout: Annotated[OptFloat, _engine("With --url: seconds to wait while the server's /health says it "
                                               "is still loading its model (default 600).")] = None,
    concurrency: Annotated[str, _work("Comma-separated levels; each keeps C requests in flight.")] = "1,8,32,64",
    num_requests: Annotated[OptStr, _work("Measured requests per level, or a comma list with one per level "
                                          "(default: max(4 x C, 32); no limit with --duration).")] = None,
    duration: Annotated[OptFloat, _work("Seconds per level; requests in flight at the end finish and count.")] = None,
    warmup: Annotated[int, _work("Warm-up requests before each level, not measured; when > 0 at least one "
                                 "wave of C requests, so the level's batch shapes are compiled first "
                                 "(baselines: one batch of each size).")] = 2,
    input_len: Annotated[int, _work("Synthetic encoder input tokens (mean).")] = 128,
    output_len: Annotated[int, _work("Output tokens per request (mean), forced exactly with ignore_eos; the "
                                     "default for dataset rows without output_tokens.")] = 128,
    input_dist: Annotated[str, _work("fixed, normal[:STDEV] or uniform[:HALF_WIDTH] (spread default: a quarter "
                                     "of the mean).")] = "fixed",
    output_dist: Annotated[str, _work("Like --input-dist, for output lengths.")] = "fixed",
    seed: Annotated[int, _work("Seed for synthetic lengths, token ids and clips.")] = 0,
    dataset: Annotated[OptStr, _work("JSONL in trtllm-bench's shape: input_ids or prompt, and output_tokens, "
                                     "one object a line.")] = None,
    hf_dataset: Annotated[OptStr, _work("Hugging Face dataset id or local path (needs 'datasets').")] = None,
    hf_split: Annotated[str, _work("Split of --hf-dataset.")] = "train",
    hf_subset: Annotated[OptStr, _work("Configuration (subset) of --hf-dataset.")] = None,
    hf_prompt_field: Annotated[str, _work("Column holding the prompt (text or token ids).")] = "prompt",
    hf_output_len_field: Annotated[OptStr, _work("Column holding each row's output length "
                                                 "(default: --output-len).")] = None,
    hf_audio_field: Annotated[OptStr, _work("Column holding audio (Whisper).")] = None,
    audio_dir: Annotated[OptStr, _work("Folder of audio clips (Whisper); WAV needs nothing, other formats "
                                       "soundfile.")] = None,
    audio_manifest: Annotated[OptStr, _work('JSONL of {"audio": path[, "output_tokens": N]}, paths relative '
                                            "to it.")] = None,
    audio_seconds: Annotated[OptFloat, _work("Synthetic clips of this length (Whisper; default 30).")] = None,
    streaming: Annotated[bool, _work("Stream outputs and time tokens as the client receives them.")] = False,
    client_processes: Annotated[OptInt, _work("With --url: client processes sharing each level's concurrency "
                                              "(default: one per 8 streams, at most half the cores); "
                                              "one Python client tops out near 20k streamed tokens/s.")] = None,
    beam_width: Annotated[int, _work("Beam search with K beams per request (best_of=K, n=1; each beam is a "
                                     "decoder row); baselines run num_beams=K. 1: greedy.")] = 1,
    temperature: Annotated[OptFloat, _work("Sample with this temperature (in-process engine only; default: "
                                           "greedy, or 1.0 when another sampling option is given).")] = None,
    top_p: Annotated[OptFloat, _work("Sample from the smallest set of tokens with this much probability.")] = None,
    top_k: Annotated[OptInt, _work("Sample from the K most likely tokens (0: off).")] = None,
    sampling_seed: Annotated[OptInt, _work("Seeded sampling: request i of the workload gets seed N+i, so "
                                           "runs repeat their tokens.")] = None,
    timestamps: Annotated[bool, _work("Whisper: decode with the timestamp prompt (no <|notimestamps|>) and "
                                      "Whisper's timestamp rules, as transcribe --timestamps.")] = False,
    timestamps_every: Annotated[OptInt, _work("Whisper, mixed workload: only every N-th request is timestamped "
                                              "(the first included; 64 at C=64: 63 plain beside one); the "
                                              "report splits each level by request kind.")] = None,
    detect_language: Annotated[bool, _work("Whisper: the first output token is chosen among the language "
                                           "tokens (the prompt is <|startoftranscript|> alone), as transcribe "
                                           "without --language.")] = False,
    baseline: Annotated[Optional[list[str]], _out("hf and/or hf-compile (repeat or comma-separate): "
                                                  "transformers generate on the same requests.")] = None,
    report_json: Annotated[OptStr, _out("Write the JSON report here (rewritten after every level).")] = None,
    csv: Annotated[OptStr, _out("Write one CSV row per backend and level here.")] = None,
    plot: Annotated[OptStr, _out("Write throughput against latency (PNG); needs matplotlib.")] = None,
    fail_under: Annotated[Optional[list[str]], _out("Exit 1 when missed: METRIC=N (at least N), METRIC<=N, "
                                                    "METRIC@C=N for one level. Repeatable.")] = None,
    quiet: Annotated[bool, _out("No progress bar.")] = False,
) -> None:
    from enc2dec.bench.errors import BenchInputError

    options = locals()
    run_command("bench", lambda: _run(options), (BenchInputError,))


def _options(o: dict):
    from enc2dec.bench.errors import BenchInputError
    from enc2dec.bench.hf_baseline import BASELINES
    from enc2dec.bench.session import BenchOptions
    from enc2dec.bench.thresholds import parse_threshold
    from enc2dec.bench.workloads import HfDatasetSpec

    baselines = _names(o["baseline"])
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise BenchInputError(f"--baseline {bad[0]!r} is not valid; valid: {', '.join(BASELINES)}")
    hf = None
    if o["hf_dataset"]:
        hf = HfDatasetSpec(o["hf_dataset"], o["hf_split"], o["hf_subset"], o["hf_prompt_field"],
                           o["hf_output_len_field"], o["hf_audio_field"])
    engine_keys = ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len", "encoder_max_batch_size",
                   "attn_backend", "cross_kv_cache_fraction", "free_gpu_memory_fraction", "kv_cache_dtype")
    opts = BenchOptions(
        model=o["model"], load_format=o["load_format"], dtype=o["dtype"], device=o["device"], config=o["config"],
        engine_overrides={**{k: o[k] for k in engine_keys if o[k] is not None},
                          **({"tensor_parallel_size": o["tp_size"]} if o["tp_size"] is not None else {}),
                          **({"data_parallel_size": o["dp_size"]} if o["dp_size"] is not None else {})},
        concurrency=_int_list(o["concurrency"], "--concurrency"),
        num_requests=_int_list(o["num_requests"], "--num-requests") if o["num_requests"] else None,
        duration_s=o["duration"], warmup=o["warmup"], input_len=o["input_len"], output_len=o["output_len"],
        input_dist=o["input_dist"], output_dist=o["output_dist"], seed=o["seed"], dataset=o["dataset"],
        hf_dataset=hf, audio_dir=o["audio_dir"], audio_manifest=o["audio_manifest"],
        audio_seconds=o["audio_seconds"], streaming=o["streaming"], beam_width=o["beam_width"],
        temperature=o["temperature"], top_p=o["top_p"], top_k=o["top_k"], sampling_seed=o["sampling_seed"],
        timestamps_every=o["timestamps_every"] if o["timestamps_every"] is not None else (1 if o["timestamps"] else None),
        detect_language=o["detect_language"],
        baselines=baselines, url=o["url"], client_processes=o["client_processes"], ready_timeout_s=o["ready_timeout"],
        thresholds=tuple(parse_threshold(t) for t in o["fail_under"] or []),
        command=command_line(o["ctx"], "bench"))
    opts.validate()
    return opts


def _run(o: dict) -> int:
    from enc2dec.bench import report
    from enc2dec.bench.session import run_bench

    opts = _options(o)
    for c in opts.concurrency:
        n = opts.level_num_requests(c)
        if n is not None and n < c:
            typer.echo(f"warning: C={c} with {n} requests: at most {n} are ever in flight", err=True)
    if o["plot"]:
        report.check_plot_available()
    primary = "http" if opts.url else "enc2dec"

    def partial(levels, meta):     # a long run that dies still leaves the levels it finished
        if o["report_json"]:
            report.write_json(o["report_json"], report.report_dict({**meta, "complete": False}, levels, primary))

    progress = report.Progress() if o["quiet"] else report.RichProgress()
    result = run_bench(opts, progress, on_level=partial)

    meta = {**result.meta, "complete": True, "exit_code": result.exit_code}
    title = f"enc2dec bench: {meta.get('model')} ({meta.get('dtype') or 'server'}, " \
            f"{meta.get('device', {}).get('name', '?')})"
    report.print_tables(result.levels, result.primary, title, report.make_console())
    if o["report_json"]:
        report.write_json(o["report_json"], report.report_dict(meta, result.levels, result.primary))
    if o["csv"]:
        report.write_csv(o["csv"], result.levels)
    if o["plot"]:
        report.write_plot(o["plot"], result.levels, title)
    for lv in result.levels:
        if lv.failed:
            typer.echo(f"FAILED: {lv.backend} C={lv.concurrency}: {lv.failed} of {lv.num_requests} requests "
                       f"failed; first errors: {' | '.join(lv.errors)}", err=True)
    for miss in result.misses:
        typer.echo(f"FAIL-UNDER: {miss}", err=True)
    return result.exit_code


def register(app: typer.Typer) -> None:
    app.command("bench", help=HELP, no_args_is_help=True)(bench)
