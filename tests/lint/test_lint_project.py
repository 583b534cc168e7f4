"""The project's own code and examples lint clean, and the pre-commit hook points at the linter."""

from __future__ import annotations

from pathlib import Path

from mixprec.lint import lint_paths

ROOT = Path(__file__).resolve().parents[2]


def test_project_sources_and_examples_lint_clean():
    paths = [p for p in (ROOT / "src", ROOT / "examples") if p.exists()]
    result = lint_paths(paths)
    assert result.files > 0
    assert [f.as_text() for f in result.findings] == []


def test_pre_commit_hook_runs_mixprec_lint_on_python_files():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    hooks = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert "- id: mixprec-lint" in hooks
    assert any(h.startswith("entry: mixprec lint") for h in hooks)
    assert "types: [python]" in hooks
