"""What every command shares: option declarations, exit-code mapping and the exact command
line for reports.

Exit codes (all commands): 0 done, 1 a check failed or the run failed, 2 bad usage or input,
130 interrupted. Bad input is a one-line error; an unexpected failure is one line too, and
``ENC2DEC_DEBUG=1`` shows its traceback.
"""
from __future__ import annotations

import os
import shlex
from typing import Callable, Optional

import typer

OptStr, OptInt, OptFloat = Optional[str], Optional[int], Optional[float]

# --dp-size, the same on every command (data_parallel_size; docs/parallel.md).
DP_SIZE_HELP = ("Data-parallel engine replicas (data_parallel_size), each in its own process with its own copy of "
                "the model on --tp-size GPUs (replica i on the i-th group of visible GPUs; on the CPU each gets "
                "cores/N threads); each request goes to the least loaded replica.")
DP_SIZE_FLAGS = ("--dp-size", "--dp_size")


def option(help_text: str, panel: str, *names: str, **kw):
    """A Typer option shown under ``panel`` in ``--help``."""
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **kw)


def run_command(name: str, body: Callable[[], int], input_errors: tuple[type[BaseException], ...]) -> None:
    """Run ``body`` and exit with its code, mapping errors to the shared exit codes."""
    try:
        code = body()
    except input_errors as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as e:  # noqa: BLE001 - a clear line, not a traceback
        if os.environ.get("ENC2DEC_DEBUG"):
            raise
        typer.echo(f"error: {name} failed: {type(e).__name__}: {e} (ENC2DEC_DEBUG=1 shows the traceback)",
                   err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def command_line(ctx: typer.Context, name: str) -> str:
    """The options given, as one shell line, rebuilt from the parse: right however the command
    was invoked (console script, ``python -m``, a test's CliRunner)."""
    parts = ["enc2dec", name]
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if source is None or source.name == "DEFAULT":
            continue
        value, flag = ctx.params[p.name], p.opts[0]
        if getattr(p, "is_flag", False):
            parts.append(flag if value else (p.secondary_opts or [flag])[0])
        else:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                parts += [flag, str(v)]
    return shlex.join(parts)
