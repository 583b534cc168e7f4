"""The lint commands the README and docs/lint.md show run as written from a clone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mixprec.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end != -1 else len(text)]


def _commands(section: str) -> list[tuple[list[str], int | None]]:
    """(argv after ``mixprec``, the exit status its comment promises) for each ``$ mixprec lint``."""
    out = []
    for line in section.splitlines():
        if not line.startswith("$ mixprec lint"):
            continue
        command, _, comment = line[2:].partition("#")
        status = re.search(r"exit (\d)", comment)
        out.append((shlex.split(command)[1:], int(status.group(1)) if status else None))
    return out


README_COMMANDS = _commands(_section((ROOT / "README.md").read_text(), "## `mixprec lint`"))


def test_the_readme_shows_lint_commands():
    assert len(README_COMMANDS) >= 2 and any(status == 1 for _, status in README_COMMANDS)


@pytest.mark.parametrize("argv, status", README_COMMANDS, ids=[" ".join(a) for a, _ in README_COMMANDS])
def test_a_readme_lint_command_runs_from_a_clone_with_the_exit_status_it_promises(argv, status, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for path in [a for a in argv[1:] if not a.startswith("-") and "/" in a]:
        assert (ROOT / path).exists(), f"{path} is not in a clone"
    code = main(argv)
    out = capsys.readouterr().out
    assert code in (0, 1), out
    if status is not None:
        assert code == status, out


DOC = (ROOT / "docs" / "lint.md").read_text()
DOC_COMMANDS = _commands(DOC)


@pytest.mark.parametrize("argv, status", DOC_COMMANDS, ids=[" ".join(a) for a, _ in DOC_COMMANDS])
def test_a_docs_lint_command_runs_from_a_clone(argv, status, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 1  # the example shows a finding
    out = capsys.readouterr().out
    assert "MP101 gradients clipped while still scaled" in out


def test_the_docs_rule_table_lists_every_rule():
    from mixprec.lint import RULES

    listed = set(re.findall(r"^\| (MP\d{3}) \| ([a-z][a-z0-9-]+) \|", DOC, flags=re.M))
    assert listed == {(r.code, r.name) for r in RULES.values()}
