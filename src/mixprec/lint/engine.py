"""Lint text, files and directory trees; apply the safe fixes.

    >>> from mixprec.lint import lint_source
    >>> [f.code for f in lint_source("import torch\\ns = torch.cuda.amp.GradScaler()\\n")]
    ['MP201']
"""

from __future__ import annotations

import ast
import fnmatch
import re
import tokenize
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.lint.checks import check
from mixprec.lint.deprecated import deprecated_hits
from mixprec.lint.fixes import Source, apply_edits
from mixprec.lint.workspace import Project
from mixprec.lint.report import Finding
from mixprec.lint.rules import RULES

SKIP_DIRS = frozenset({".venv", "venv", "build", "dist", "__pycache__", "node_modules"})
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.I)
_FIX_PASSES = 3  # a fix can expose another (nested calls); each pass re-parses


def _hits(text: str, path: str | None = None, project: Project | None = None):
    """(hits, source) of one file's text, or (SyntaxError, source) when it does not parse."""
    source = Source(text)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # invalid escapes etc. are not ours
            tree = ast.parse(text)
    except (SyntaxError, ValueError) as error:  # ValueError: null bytes
        if not isinstance(error, SyntaxError):
            error = SyntaxError(str(error), (None, 1, 0, ""))
        return error, source
    script = (project or Project()).for_text(text, tree, path)
    return [*check(script), *deprecated_hits(script, source)], source


def _suppressed(source: Source, line: int, code: str) -> bool:
    if line > len(source.lines):
        return False
    match = _NOQA.search(source.lines[line - 1])
    if match is None:
        return False
    codes = match.group("codes")
    return codes is None or code in {c.upper() for c in re.split(r"[\s,]+", codes)}


def _findings(text: str, path: str, codes: set[str], project: Project | None = None) -> tuple[list[Finding], list[tuple]]:
    """Findings (sorted) and, for the fixable ones, their edit groups."""
    result, source = _hits(text, path, project)
    if isinstance(result, SyntaxError):
        line = result.lineno or 1
        col = result.offset or 1
        finding = Finding(path, line, col, "MP000", f"syntax error: {result.msg}")
        return ([finding] if "MP000" in codes else []), []
    findings, groups = [], []
    for hit in result:
        line = hit.node.lineno
        if hit.code not in codes or _suppressed(source, line, hit.code):
            continue
        findings.append(Finding(path, line, source.column(hit.node), hit.code, hit.message, hit.edits is not None))
        if hit.edits is not None and RULES[hit.code].fixable:
            groups.append(hit.edits)
    findings.sort(key=lambda f: (f.line, f.col, f.code))
    return findings, groups


def lint_source(
    text: str, path: str = "<string>", codes: set[str] | None = None, project: Project | None = None
) -> list[Finding]:
    """The findings for one file's text. ``codes``: the rule codes to report (default all).
    ``project``: the files linted together (shared by ``lint_paths``), whose modules a call
    into another file of the project is followed into; a new one when None."""
    return _findings(text, path, set(RULES) if codes is None else codes, project)[0]


def fix_source(text: str, codes: set[str] | None = None, path: str | None = None) -> tuple[str, int]:
    """``text`` with every safe fix applied, and how many findings were fixed.

    A rewrite that would not parse is dropped, so --fix never breaks a file. ``path``: the
    file the text comes from, for names it star-imports from its own project.
    """
    codes = set(RULES) if codes is None else codes
    fixed = 0
    for _ in range(_FIX_PASSES):
        _, groups = _findings(text, path or "<fix>", codes)
        if not groups:
            break
        new, applied = apply_edits(text, groups)
        if not _parses(new):  # keep the groups that parse on their own, one at a time
            new, applied = text, 0
            for group in groups:
                candidate, n = apply_edits(new, [group])
                if n and _parses(candidate):
                    new, applied = candidate, applied + 1
                    break  # offsets of the other groups refer to the old text: next pass
        if not applied:
            break
        text, fixed = new, fixed + applied
    return text, fixed


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


# --- files -----------------------------------------------------------------------------------


def read_text(path: Path) -> tuple[str, str]:
    """(text, encoding), honouring a PEP 263 coding line."""
    with path.open("rb") as handle:
        encoding, _ = tokenize.detect_encoding(handle.readline)
    return path.read_bytes().decode(encoding), encoding


def iter_python_files(paths: list[Path], exclude: list[str] = ()) -> list[Path]:
    """Files named on the command line as given; directories walked for ``*.py``, skipping
    hidden directories, virtual environments, build output and ``exclude`` globs."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
            continue
        for candidate in sorted(path.rglob("*.py")):
            parts = candidate.relative_to(path).parts
            if any(p.startswith(".") or p in SKIP_DIRS for p in parts[:-1]):
                continue
            text = candidate.as_posix()
            if any(fnmatch.fnmatch(text, g) or fnmatch.fnmatch(candidate.name, g) for g in exclude):
                continue
            found.append(candidate)
    return found


@dataclass
class LintResult:
    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    fixed: dict[str, int] = field(default_factory=dict)  # path -> findings fixed

    @property
    def files_with_findings(self) -> int:
        return len({f.path for f in self.findings})


def lint_paths(
    paths: list[str | Path],
    codes: set[str] | None = None,
    fix: bool = False,
    exclude: list[str] = (),
) -> LintResult:
    """Lint files and directories; with ``fix`` rewrite files in place first.

    Raises FileNotFoundError for a path that does not exist.
    """
    if isinstance(paths, (str, Path)):  # one path, not a string to iterate character by character
        paths = [paths]
    codes = set(RULES) if codes is None else codes
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(", ".join(missing))
    result = LintResult()
    project = Project()  # one per run: each module parsed once, whichever file imports it
    for path in iter_python_files([Path(p) for p in paths], exclude):
        result.files += 1
        name = str(path)
        try:
            text, encoding = read_text(path)
        except (OSError, UnicodeDecodeError, SyntaxError) as error:
            if "MP000" in codes:
                result.findings.append(Finding(name, 1, 1, "MP000", f"cannot read the file: {error}"))
            continue
        if fix:
            new, count = fix_source(text, codes, name)
            if count:
                path.write_bytes(new.encode(encoding))
                result.fixed[name] = count
                text = new
        result.findings.extend(lint_source(text, name, codes, project))
    return result
