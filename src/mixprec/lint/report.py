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

    @property
    def name(self) -> str:
        return RULES[self.code].name

    @property
    def severity(self) -> str:
        """"error" (a trap: exit status 1) or "info" (worth knowing; does not fail the run)."""
        return RULES[self.code].severity

    def as_text(self) -> str:
        note = " (info)" if self.severity == "info" else ""
        return f"{self.path}:{self.line}:{self.col}: {self.code}{note} {self.message}"

    def as_dict(self) -> dict:
        rule = RULES[self.code]
        return {**asdict(self), "name": rule.name, "why": rule.why, "fix": rule.fix, "severity": rule.severity}
