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


def test_pre_commit_hooks_run_mixprec_lint_on_python_files():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    hooks: dict[str, dict[str, str]] = {}
    for line in lines:
        key, _, value = line.removeprefix("- ").partition(": ")
        if line.startswith("- id: "):
            current = hooks[value] = {}
        current[key] = value
    # the default hook installs nothing (no torch): it uses the environment's mixprec
    assert hooks["mixprec-lint"]["language"] == "system"
    assert hooks["mixprec-lint-isolated"]["language"] == "python"
    for hook in hooks.values():
        assert hook["entry"].startswith("mixprec lint") and hook["types"] == "[python]"


def test_lint_paths_takes_a_single_path_as_one_path(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    for one in (str(tmp_path / "src"), tmp_path / "src"):
        result = lint_paths(one)  # was read as the paths '/', 't', 'm', 'p'...
        assert result.files == 1 and [f.code for f in result.findings] == ["MP201"]
