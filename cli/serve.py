"""``enc2dec serve``: an OpenAI-compatible server (completions, Whisper transcriptions).

A thin command: options in, ``enc2dec.serve.server.run_server`` does the work. FastAPI,
uvicorn and pydantic are imported only when the command runs (the ``serve`` extra).
Exit codes: 0 stopped cleanly, 1 the engine failed or a SIGTERM drain had to cut requests, 2 bad usage, a model or option the
engine refuses, a port that cannot be bound, or a missing extra.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Annotated

import typer

from enc2dec.cli.common import DP_SIZE_FLAGS, DP_SIZE_HELP, OptInt, OptStr, option

HELP = """Serve a model over HTTP with OpenAI's API.

Endpoints: POST /v1/completions, /v1/audio/transcriptions, /v1/audio/translations;
GET /v1/models, /health (200 once the engine is up), /version, /metrics (Prometheus).
SIGTERM drains: no new requests, in-flight ones finish, then exit. Details: docs/serve.md.

Examples:

  enc2dec serve google/flan-t5-small --config enc-dec-config.yaml

  ENC2DEC_API_KEY=secret enc2dec serve openai/whisper-large-v3 --host 0.0.0.0
    --port 8000 --max-queue 64

  enc2dec serve google/flan-t5-large --api-processes 4   (many streams, one GPU)
"""

REQUIRED_MODULES = ("fastapi", "uvicorn", "pydantic", "multipart", "prometheus_client")


S, E, R = "Server", "Engine", "Ray"
# serve's own engine defaults where the config leaves a key unset: the step loop in its own
# process, away from the event loop's GIL (the library API's LLM keeps one process).
SERVE_ENGINE_DEFAULTS = {"engine_process": True}


def serve(
    model: Annotated[str, typer.Argument(help="Hugging Face folder or hub id (with --load-format dummy also a "
                                              "known name such as google/flan-t5-small).")],
    config: Annotated[OptStr, option("Engine YAML (LLM option names, e.g. the guide's enc-dec-config.yaml).",
                                   E)] = None,
    backend: Annotated[str, option("Only 'pytorch' (accepted for trtllm-serve command lines).", E)] = "pytorch",
    load_format: Annotated[OptStr, option("auto (the checkpoint's weights) or dummy (random).", E)] = None,
    dtype: Annotated[OptStr, option("auto, float32, float16 or bfloat16.", E)] = None,
    device: Annotated[OptStr, option("auto, cpu, cuda or cuda:N.", E)] = None,
    tokenizer: Annotated[OptStr, option("Tokenizer folder or id, if not the model's.", E)] = None,
    max_batch_size: Annotated[OptInt, option("Most decoder sequences running at once.", E)] = None,
    tp_size: Annotated[OptInt, option("Tensor-parallel GPUs.", E, "--tp-size", "--tp_size")] = None,
    dp_size: Annotated[OptInt, option(DP_SIZE_HELP + " /health and /metrics report each replica.", E,
                                      *DP_SIZE_FLAGS)] = None,
    max_beam_width: Annotated[OptInt, option("Widest beam search a request may ask for (best_of with "
                                           "use_beam_search); each beam is a decoder sequence.", E,
                                           "--max-beam-width", "--max_beam_width")] = None,
    engine_process: Annotated[bool | None, option("Run the engine core in its own process (default: on; the "
                                                  "config key engine_process), so the HTTP side never "
                                                  "shares a GIL with the step loop.", E,
                                                  "--engine-process/--no-engine-process")] = None,
    api_processes: Annotated[OptInt, option("HTTP processes over the one engine process (vLLM's --api-server-count): "
                                            "each parses requests and streams tokens on its own core, sharing the "
                                            "port; one carries about 20k streamed tokens/s. Default auto: with a "
                                            "GPU engine a quarter of the cores, at most 4; on the CPU 1. More than "
                                            "1 needs the engine process; not with --dp-size or --ray-address.",
                                            S)] = None,
    host: Annotated[str, option("Address to listen on (0.0.0.0 for every interface).", S)] = "127.0.0.1",
    port: Annotated[int, option("Port (0 picks a free one; the log names it).", S)] = 8000,
    api_key: Annotated[OptStr, option("Require 'Authorization: Bearer KEY' on every endpoint but /health.", S,
                                    envvar="ENC2DEC_API_KEY", show_envvar=True)] = None,
    served_model_name: Annotated[list[str] | None, option("Model name(s) clients use (default: MODEL). "
                                                           "Repeatable.", S)] = None,
    max_queue: Annotated[int, option("Decoder sequences (prompts x n x beams) waiting for a slot; beyond it 503 "
                                     "with Retry-After, and 400 for one request larger than it.", S)] = 256,
    max_upload_mb: Annotated[float, option("Largest request body (audio upload or JSON), MB.", S)] = 25.0,
    max_prompt_tokens: Annotated[OptInt, option("Longest prompt in tokens (default: the engine's "
                                              "max_input_len).", S)] = None,
    max_audio_s: Annotated[float, option("Longest audio upload in seconds (longer than 30 s is decoded in "
                                       "windows, as enc2dec transcribe does).", S)] = 3600.0,
    long_form_strategy: Annotated[str, option("Audio over 30 s: vad (Silero VAD's speech regions packed into 30 s "
                                            "windows decoded at once; the most accurate; needs silero-vad, in the "
                                            "audio extra), chunked (overlapping windows decoded at once) or "
                                            "sequential (seek by predicted timestamps, one window at a time).",
                                            S)] = "vad",
    drain_timeout: Annotated[float, option("SIGTERM: the drain ends within this many seconds; requests still "
                                         "running then are cut and the exit code is 1.", S)] = 600.0,
    request_timeout_s: Annotated[float, option("Longest time a request body may take to arrive, seconds (then "
                                             "408).", S)] = 60.0,
    keep_alive_s: Annotated[float, option("Idle keep-alive connections are closed after this many seconds.",
                                        S)] = 5.0,
    allowed_origins: Annotated[list[str] | None, option("CORS: a browser origin allowed to call the API (e.g. "
                                                         "https://app.example.com, or *). Repeatable; default "
                                                         "none (CORS off).", S)] = None,
    log_level: Annotated[str, option("critical, error, warning, info or debug (debug adds an access log).",
                                   S)] = "info",
    ray_address: Annotated[OptStr, option("Deploy on a Ray cluster with Ray Serve instead (one engine per replica, "
                                        "Ray's proxy on --host/--port): auto, local or an address such as "
                                        "ray://head:10001. Needs the ray extra; see docs/parallel.md.", R)] = None,
    ray_replicas: Annotated[int, option("With --ray-address: a fixed number of replicas.", R)] = 1,
    ray_autoscaling: Annotated[OptStr, option("With --ray-address: Ray Serve's autoscaling_config as JSON (instead "
                                            "of --ray-replicas), e.g. '{\"min_replicas\": 1, \"max_replicas\": 8, "
                                            "\"target_ongoing_requests\": 32}'.", R)] = None,
) -> None:
    missing = [m for m in REQUIRED_MODULES if not _importable(m)]
    if missing:
        typer.echo(f"error: enc2dec serve needs {', '.join(missing)}: pip install 'enc2dec[serve]'", err=True)
        raise typer.Exit(2)
    if backend != "pytorch":
        typer.echo(f"error: --backend {backend!r} is not supported; valid: pytorch", err=True)
        raise typer.Exit(2)
    from enc2dec.serve.config import ServeConfig, build_llm_args

    try:
        cfg = ServeConfig(model=model, served_model_names=tuple(served_model_name or ()), host=host, port=port,
                          api_key=api_key or None, max_queue=max_queue,
                          max_upload_bytes=max(1, int(max_upload_mb * (1 << 20))),
                          max_prompt_tokens=max_prompt_tokens, max_audio_s=max_audio_s,
                          long_form_strategy=long_form_strategy,
                          drain_timeout_s=drain_timeout, request_timeout_s=request_timeout_s,
                          keep_alive_s=keep_alive_s, allowed_origins=tuple(allowed_origins or ()),
                          log_level=log_level, api_processes=api_processes)
        llm_args = build_llm_args(model, config, load_format=load_format, dtype=dtype, device=device,
                                  tokenizer=tokenizer, max_batch_size=max_batch_size,
                                  tensor_parallel_size=tp_size, data_parallel_size=dp_size,
                                  max_beam_width=max_beam_width,
                                  engine_process=engine_process, defaults=SERVE_ENGINE_DEFAULTS)
    except (ValueError, TypeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if ray_address and llm_args.data_parallel_size > 1:
        typer.echo("error: --dp-size with --ray-address: Ray Serve runs the replicas there (--ray-replicas or "
                   "--ray-autoscaling); use one or the other", err=True)
        raise typer.Exit(2)
    if cfg.api_processes is not None and cfg.api_processes > 1:
        why = ("it needs the engine in its own process (drop --no-engine-process)" if not llm_args.engine_process
               else "not with --dp-size yet" if llm_args.data_parallel_size > 1
               else "not with --ray-address (Ray Serve runs its own HTTP proxy)" if ray_address else None)
        if why:
            typer.echo(f"error: --api-processes {cfg.api_processes}: {why}", err=True)
            raise typer.Exit(2)
    from enc2dec.serve.server import setup_logging

    setup_logging(cfg.log_level)
    if ray_address:
        raise typer.Exit(_serve_on_ray(cfg, llm_args, ray_address, ray_replicas, ray_autoscaling))
    from enc2dec.serve.server import run_server

    try:
        code = run_server(cfg, llm_args)
    except ValueError as e:             # the address cannot be bound
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    # The server and the engine have stopped. Interpreter teardown with torch loaded takes
    # seconds more, which an orchestrator would count against the drain: skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve_on_ray(cfg, llm_args, address: str, replicas: int, autoscaling: str | None) -> int:
    import json

    try:
        scaling = json.loads(autoscaling) if autoscaling else None
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError("--ray-autoscaling must be a JSON object")
        from enc2dec.serve.ray_serve import run

        return run(cfg, llm_args, address, num_replicas=None if scaling else replicas, autoscaling_config=scaling)
    except ValueError as e:          # bad JSON, no Ray, no cluster, a bad replica count
        typer.echo(f"error: {e}", err=True)
        return 2


def _importable(module: str) -> bool:
    # Found, not imported: prometheus_client picks its multi-process mode at import, which
    # --api-processes sets up later.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def register(app: typer.Typer) -> None:
    app.command(name="serve", help=HELP, no_args_is_help=True)(serve)
