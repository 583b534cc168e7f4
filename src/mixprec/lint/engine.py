"""Lint text, files and directory trees; apply the safe fixes.

    >>> from mixprec.lint import lint_source
    >>> [f.code for f in lint_source("import torch\\ns = torch.cuda.amp.GradScaler()\\n")]
    ['MP201']
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
import tokenize
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from mixprec.lint.checks import check
from mixprec.lint.deprecated import deprecated_hits
from mixprec.lint.fixes import Source, apply_edits, write_atomically
from mixprec.lint.notebooks import is_notebook, notebook_code
from mixprec.lint.workspace import Project
from mixprec.lint.report import Finding
from mixprec.lint.rules import RULES

SKIP_DIRS = frozenset({".venv", "venv", "build", "dist", "__pycache__", "node_modules"})
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.I)
_FIX_PASSES = 3  # a fix can expose another (nested calls); each pass re-parses


class _Unchecked(NamedTuple):
    """Why a file's text was not checked: it does not parse, or the linter failed on it."""

    line: int
    col: int
    message: str
    internal: bool = False  # the linter's failure (exit status 3), not a problem in the file


def _syntax_message(error: SyntaxError) -> str:
    """The message for a text this interpreter cannot parse, naming the interpreter: a file
    may be valid on a newer Python (a PEP 701 f-string reusing its quotes, valid from 3.12, was
    reported as a plain syntax error under 3.11: found by a probe of real scripts)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    message = f"syntax error with Python {version} (the Python running mixprec): {error.msg}"
    if sys.version_info < (3, 12) and error.msg.startswith("f-string"):
        return message + "; valid from Python 3.12 if the f-string reuses its quotes or nests them (PEP 701)"
    return message + "; the file may be valid on a newer Python"


def _parse(text: str) -> ast.Module | _Unchecked:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # invalid escapes etc. are not ours
            return ast.parse(text)
    except SyntaxError as error:
        return _Unchecked(error.lineno or 1, error.offset or 1, _syntax_message(error))
    except ValueError as error:  # null bytes
        return _Unchecked(1, 1, f"syntax error: {error}")
    except (RecursionError, MemoryError) as error:
        # a 5,000-branch elif or a 3,000-term sum (found by a probe of real scripts): Python
        # cannot compile the file either, so it is a problem of the file, like a syntax error
        return _Unchecked(1, 1, f"too deeply nested for Python's parser ({type(error).__name__}): not checked")


def _hits(text: str, path: str | None = None, project: Project | None = None):
    """(hits, source) of one file's text, or (_Unchecked, source) when it was not checked."""
    source = Source(text)
    tree = _parse(text)
    if isinstance(tree, _Unchecked):
        return tree, source
    try:
        script = (project or Project()).for_text(text, tree, path)
        return [*check(script), *deprecated_hits(script, source)], source
    except Exception as error:  # noqa: BLE001 - one file's failure must not end a directory run
        # RecursionError: the rules walk nested code recursively, and a valid file nested deeply
        # enough (a 900-branch elif in a function) exhausts the stack; anything else is a bug
        why = "nested too deeply for the linter" if isinstance(error, RecursionError) else "internal error"
        message = f"lint could not analyse this file ({why}: {type(error).__name__}); nothing in it was checked"
        return _Unchecked(1, 1, message, internal=True), source


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
    cells = None
    if is_notebook(path):
        try:
            cells = notebook_code(text)
        except ValueError as error:
            return ([Finding(path, 1, 1, "MP000", str(error))] if "MP000" in codes else []), []
        text = cells.text
    result, source = _hits(text, path, project)
    if isinstance(result, _Unchecked):
        finding = Finding(path, result.line, result.col, "MP000", result.message, internal=result.internal)
        # a file the linter failed on is always said, whatever --select: nothing in it was checked
        findings = [finding] if "MP000" in codes or result.internal else []
        return [_in_cell(f, cells) for f in findings], []
    findings, groups = _broken_cells(path, cells) if "MP000" in codes else [], []
    for hit in result:
        line = hit.node.lineno
        if hit.code not in codes or _suppressed(source, line, hit.code):
            continue
        fixable = hit.edits is not None and cells is None  # a notebook's JSON is not rewritten
        findings.append(_in_cell(Finding(path, line, source.column(hit.node), hit.code, hit.message, fixable), cells))
        if fixable and RULES[hit.code].fixable:
            groups.append(hit.edits)
    findings.sort(key=lambda f: (f.cell or 0, f.line, f.col, f.code))
    return findings, groups


def _broken_cells(path: str, cells) -> list[Finding]:
    """MP000, as information, for each notebook cell that does not parse on its own (left out of the script):
    notebooks hold shell lines and ``<your-api-key>`` placeholders that were never Python, and a run over a
    directory of them must not fail on those (found on the probe's corpus: 8 such cells)."""
    return [
        Finding(path, error.lineno or 1, error.offset or 1, "MP000",
                f"{_syntax_message(error)} (this cell was left out; the other cells were checked)", cell=cell,
                note=True)
        for cell, error in (cells.broken if cells is not None else ())
    ]


def _in_cell(finding: Finding, cells) -> Finding:
    """The finding placed by notebook cell and line in the cell (unchanged for a script)."""
    if cells is None:
        return finding
    cell, line = cells.place(finding.line)
    return replace(finding, cell=cell, line=line)


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
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


# --- files -----------------------------------------------------------------------------------


def read_text(path: Path) -> tuple[str, str]:
    """(text, encoding), honouring a PEP 263 coding line."""
    with path.open("rb") as handle:
        encoding, _ = tokenize.detect_encoding(handle.readline)
    return path.read_bytes().decode(encoding), encoding


def iter_python_files(paths: list[Path], exclude: list[str] = ()) -> list[Path]:
    """Files named on the command line as given; directories walked for ``*.py`` and
    ``*.ipynb`` files, skipping hidden directories (``.ipynb_checkpoints`` among them), virtual
    environments, build output and ``exclude`` globs. A directory whose name ends in ``.py``
    (``pkg.py/__init__.py``) is walked into, not read as a file (found by a probe of real
    scripts)."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
            continue
        candidates = [*path.rglob("*.py"), *path.rglob("*.ipynb")]
        for candidate in sorted(candidates):
            parts = candidate.relative_to(path).parts
            if any(p.startswith(".") or p in SKIP_DIRS for p in parts[:-1]) or not candidate.is_file():
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

    @property
    def failed(self) -> list[str]:
        """The files the linter failed on (nothing in them was checked): exit status 3."""
        return sorted({f.path for f in self.findings if f.internal})


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
        if fix and not is_notebook(name):  # a notebook's JSON is linted, not rewritten
            new, count = fix_source(text, codes, name)
            if count:
                write_atomically(path, new.encode(encoding))  # never half a script, whatever stops us
                result.fixed[name] = count
                text = new
        result.findings.extend(lint_source(text, name, codes, project))
    return result
