"""The one error type eval raises for the user's mistakes (the CLI maps it to exit code 2)."""
from __future__ import annotations


class EvalInputError(ValueError):
    """Bad usage or bad data: an option, a file, a dataset that cannot be read, all rows bad.

    The message is shown as is, so it names the option / file / field and what would be valid.
    """
