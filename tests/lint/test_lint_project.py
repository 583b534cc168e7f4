"""The project's own code and examples lint clean, and the pre-commit hook points at the linter."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.lint import lint_paths, lint_source

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


def _star_project(tmp_path, general: str) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "general.py").write_text(general)
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "from utils.general import *\n"
        "scaler = amp.GradScaler()\n"
        "with torch.cuda.amp.autocast():\n"
        "    loss = model(x)\n"
        "scaler.scale(loss).backward()\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "scaler.step(opt)\n"
        "scaler.update()\n"
    )
    return script


def test_torch_reached_through_a_star_import_of_the_project_is_resolved(tmp_path):
    script = _star_project(tmp_path, "import torch\nfrom torch.cuda import amp\n")
    result = lint_paths([script])
    assert [(f.line, f.code) for f in result.findings] == [(2, "MP201"), (3, "MP201"), (6, "MP101")]
    fixed = lint_paths([script], fix=True)
    assert fixed.fixed == {str(script): 2}
    assert 'torch.amp.GradScaler("cuda")' in script.read_text() and 'torch.autocast("cuda")' in script.read_text()


@pytest.mark.parametrize(
    "general",
    [
        "import torch\nfrom torch.cuda import amp\n__all__ = ['helper']\ndef helper(): pass\n",  # not exported
        "import torch as _torch\n",  # private names are not star-exported
        "torch = make_torch()\namp = None\n",  # assigned, not imported
    ],
    ids=["all-excludes", "private", "assigned"],
)
def test_a_star_module_that_does_not_export_torch_gives_no_torch(tmp_path, general):
    script = _star_project(tmp_path, general)
    assert lint_paths([script]).findings == []


def test_a_star_import_is_not_resolved_outside_the_project_or_without_a_file(tmp_path):
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "general.py").write_text("import torch\n")
    inner = tmp_path / "proj"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("")
    script = inner / "train.py"
    script.write_text("from utils.general import *\ns = torch.cuda.amp.GradScaler()\n")
    assert lint_paths([script]).findings == []  # utils/ lies above the project's root
    assert lint_source(script.read_text()) == []  # text without a path: nothing to look up
