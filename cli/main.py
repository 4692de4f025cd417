"""The ``enc2dec`` command: one thin Typer module per subcommand."""
from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(
    name="enc2dec",
    help="Fast inference for Hugging Face encoder-decoder models (T5, BART, mBART, Whisper).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main() -> None:
    """Fast inference for Hugging Face encoder-decoder models (T5, BART, mBART, Whisper)."""
    _exit_without_collecting()


def _exit_without_collecting() -> None:
    """The process ends after the command: freeze the heap at exit (an atexit hook; the others still
    run), so the interpreter's final collection does not walk a loaded model and transformers'
    import graph for nothing: ~1 s of every command's exit on a 2-core AMD EPYC
    (docs/benchmarks.md, session 39), which scripts calling enc2dec in a loop pay each time."""
    import atexit
    import gc

    if not getattr(_exit_without_collecting, "done", False):
        _exit_without_collecting.done = True
        atexit.register(gc.freeze)


@app.command()
def version() -> None:
    """Print the enc2dec, torch and transformers versions."""
    from importlib.metadata import version as v

    typer.echo(f"enc2dec {v('enc2dec')}")
    for pkg in ("torch", "transformers", "triton"):
        try:
            typer.echo(f"{pkg} {v(pkg)}")
        except Exception:  # noqa: BLE001 - optional packages
            typer.echo(f"{pkg} not installed")


def _register() -> None:
    # Each command module exposes `register(app)`; a missing one is simply not offered.
    import importlib

    for name in ("bench", "transcribe", "serve", "eval_cmd"):
        try:
            module = importlib.import_module(f"enc2dec.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"enc2dec.cli.{name}":
                continue
            raise
        module.register(app)


_register()

if __name__ == "__main__":
    # Nothing from the working directory, as with the `enc2dec` console script: `python -m` puts
    # it first on sys.path, and from a checkout's root kernels/ (installed as enc2dec.kernels)
    # would shadow the `kernels` distribution that transformers 5.25 imports with its models.
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(os.curdir)]
    app()
