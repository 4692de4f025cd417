"""``--fail-under`` checks: ``METRIC[@CONCURRENCY] OP NUMBER``.

``out_tok_per_s=5000`` means "at least 5000" (the value must not fall under it);
``p99_e2e_ms<=800`` states the operator. Operators: ``=`` (same as ``>=``), ``>=``,
``>``, ``<=``, ``<``. Without ``@C`` a check applies to every level of the benched
backend (the engine or ``--url``), never to baselines.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from .errors import BenchInputError
from .metrics import LevelMetrics, metric_names

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "=": operator.ge}
_PATTERN = re.compile(r"^\s*([a-z0-9_]+)\s*(?:@\s*(\d+))?\s*(>=|<=|>|<|=)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Threshold:
    metric: str
    op: str
    value: float
    concurrency: int | None = None

    def __str__(self) -> str:
        at = f"@{self.concurrency}" if self.concurrency is not None else ""
        return f"{self.metric}{at} {'>=' if self.op == '=' else self.op} {self.value:g}"

    def check(self, level: LevelMetrics) -> str | None:
        """None when met, else a line saying what missed."""
        actual = level.get(self.metric)
        where = f"{level.backend} c={level.concurrency}"
        if actual is None:
            return f"{where}: {self.metric} was not measured, so {self} cannot be met"
        if _OPS[self.op](actual, self.value):
            return None
        return f"{where}: {self.metric} = {actual:.4g}, wanted {self}"


def parse_threshold(text: str) -> Threshold:
    m = _PATTERN.match(text or "")
    if not m:
        raise BenchInputError(f"--fail-under {text!r} is not valid; write METRIC=NUMBER (at least) or "
                              "METRIC<=NUMBER, e.g. out_tok_per_s=5000 or p99_e2e_ms<=800 (add @C for "
                              "one concurrency level: out_tok_per_s@64=5000)")
    name, conc, op, number = m.groups()
    if name not in metric_names():
        raise BenchInputError(f"--fail-under {text!r}: unknown metric {name!r}; valid: {', '.join(metric_names())}")
    try:
        value = float(number)
    except ValueError:
        raise BenchInputError(f"--fail-under {text!r}: {number!r} is not a number") from None
    return Threshold(name, op, value, int(conc) if conc is not None else None)


def check_thresholds(thresholds: list[Threshold], levels: list[LevelMetrics]) -> list[str]:
    """Every miss, as a readable line; an empty list means all met."""
    misses = []
    for t in thresholds:
        targets = [lv for lv in levels if t.concurrency is None or lv.concurrency == t.concurrency]
        if not targets:
            misses.append(f"{t}: no level ran at concurrency {t.concurrency}")
        misses += [msg for lv in targets if (msg := t.check(lv)) is not None]
    return misses
