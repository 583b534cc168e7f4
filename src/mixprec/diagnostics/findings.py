"""A doctor finding: one check's status, what it saw, and what to do."""

from __future__ import annotations

import dataclasses
from typing import Any

STATUSES = ("alarm", "warn", "info", "ok", "skipped")  # most to least severe


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the checklist.

    Attributes:
        check: a stable id ("recipe-step", "fp32", "loss-fp32", "unscale-clip", "math-domain",
            "norm-variance", "bf16", "activation-range", "grad-underflow", "update-vanishing", "loss-scale").
        title: the question the check answers.
        status: "alarm" (a fault), "warn" (a risk), "info", "ok", "skipped".
        summary: one sentence.
        evidence: the numbers behind it, a line each.
        fix: what to do (empty when nothing).
        module, op, cause, where: the place and the cause code, when the finding has one.
    """

    check: str
    title: str
    status: str
    summary: str
    evidence: tuple[str, ...] = ()
    fix: str = ""
    module: str | None = None
    op: str | None = None
    cause: str | None = None
    where: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"finding status {self.status!r} is not one of {STATUSES}")

    @property
    def alarming(self) -> bool:
        return self.status == "alarm"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["evidence"] = list(self.evidence)
        return d
