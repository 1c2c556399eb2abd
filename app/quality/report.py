"""A check's verdict and a file's report; plain data, ready for JSON."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Verdict = Literal["pass", "fail", "skipped"]
VERDICTS = ("pass", "fail", "skipped")
CHECKS = ("finite", "silence", "clipping", "length", "quality", "voice", "words")  # every report's, in order


class GateMode(enum.StrEnum):
    """A book's quality gate, chosen when it is submitted (`app.books.quality` honours it)."""

    ON = "on"  # hear every segment, render a failing one again (up to WAVEFARM_QUALITY_RERENDERS), report
    REPORT = "report"  # hear and report only: nothing is rendered again
    OFF = "off"  # not heard: the report says the gate was off


@dataclass(frozen=True)
class Check:
    """One check: its score, the bound it was held to, and why it failed or was not run."""

    name: str
    verdict: Verdict
    score: float | None = None
    threshold: str = ""  # the bound as a reader reads it: ">= 1.6", "0.4..2.5"
    reason: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


@dataclass(frozen=True)
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.reason}" for c in self.checks if c.failed]

    def to_dict(self) -> dict[str, Any]:
        return {"pass": self.passed, "reasons": self.reasons,
                "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in self.checks}}
