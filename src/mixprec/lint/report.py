"""The records the linter passes around: an edit, a raw hit, a finding as users see it."""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

from mixprec.lint.rules import RULES


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` (character offsets) with ``new``."""

    start: int
    end: int
    new: str


@dataclass(frozen=True)
class Hit:
    """A rule's report on one AST node. ``edits`` is the exact rewrite when there is one; all
    of them apply together or none does."""

    code: str
    node: ast.AST
    message: str
    edits: tuple[Edit, ...] | None = None


@dataclass(frozen=True)
class Finding:
    path: str
    line: int  # 1-based
    col: int  # 1-based, in characters
    code: str
    message: str
    fixable: bool = False
    cell: int | None = None  # a notebook's cell (1-based); ``line`` is then the line in that cell
    internal: bool = False  # the linter failed on the file (exit status 3), not a problem in it
    note: bool = False  # said as information whatever the rule's severity (a notebook cell that does not parse)

    @property
    def name(self) -> str:
        return RULES[self.code].name

    @property
    def severity(self) -> str:
        """"error" (a trap: exit status 1) or "info" (worth knowing; does not fail the run)."""
        return "info" if self.note else RULES[self.code].severity

    def as_text(self) -> str:
        note = " (info)" if self.severity == "info" else ""
        where = f"{self.path}:cell {self.cell}" if self.cell is not None else self.path
        return f"{where}:{self.line}:{self.col}: {self.code}{note} {self.message}"

    def as_dict(self) -> dict:
        """The JSON object; ``cell`` only for a notebook, ``internal`` only when true."""
        rule = RULES[self.code]
        out = {**asdict(self), "name": rule.name, "why": rule.why, "fix": rule.fix, "severity": self.severity}
        del out["note"]
        if self.cell is None:
            del out["cell"]
        if not self.internal:
            del out["internal"]
        return out
