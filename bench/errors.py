"""The one error type the bench raises for the user's mistakes (the CLI maps it to exit code 2)."""
from __future__ import annotations


class BenchInputError(ValueError):
    """Bad usage or bad input: an option, a dataset row, an audio file, an unreachable URL.

    The message is shown as is, so it names the option / file / line and what would be valid.
    """
