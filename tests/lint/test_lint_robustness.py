"""Files that broke or fooled the linter itself, found by a probe of real scripts: nesting deep
enough to exhaust the stack, a notebook read as a dict expression, a directory named ``pkg.py``,
syntax newer than the running Python; and the exit status of a run the linter failed in."""

from __future__ import annotations

import json
import sys

import pytest

from mixprec.cli import main
from mixprec.lint import lint_paths, lint_source
from mixprec.lint import engine

TRAPS = "import torch\nscaler = torch.cuda.amp.GradScaler()\nwith torch.autocast('cuda'):\n    loss = model(x)\n    loss.backward()\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return tmp_path


def _elif_chain(branches: int, body: str = "x = {i}", indent: str = "") -> str:
    lines = [f"{indent}if a == 0:", f"{indent}    pass"]
    for i in range(1, branches):
        lines += [f"{indent}elif a == {i}:", f"{indent}    " + body.format(i=i)]
    return "\n".join(lines) + "\n"


# --- deep nesting --------------------------------------------------------------------------------


def test_a_thousand_branch_elif_at_module_level_is_linted():
    # _module_statements recursed once per elif: RecursionError, a traceback that ended the run
    text = "import torch\n" + _elif_chain(1000) + "def f():\n    return torch.cuda.amp.GradScaler()\n"
    assert [f.code for f in lint_source(text)] == ["MP201"]


def test_a_file_too_deep_for_pythons_parser_is_mp000_and_the_run_goes_on(project, capsys):
    (project / "deep.py").write_text("import torch\nx = " + " + ".join(["a"] * 3000) + "\n")
    (project / "train.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    assert main(["lint", "--format", "concise", str(project)]) == 1
    out = capsys.readouterr().out
    assert "deep.py:1:1: MP000 too deeply nested for Python's parser" in out
    assert "train.py:2:10: MP201" in out


def test_a_rule_that_runs_out_of_stack_leaves_an_mp000_and_exit_status_3(project, capsys, monkeypatch):
    # a 900-branch elif in a function once exhausted the rules' recursive walk (the walk of an
    # elif chain is a loop now: tests/lint/test_lint_probe_flow.py); any rule that still recurses
    # too deep must end the same way
    def too_deep(script):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(engine, "check", too_deep)
    (project / "deep.py").write_text("import torch\n")
    (project / "train.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    assert main(["lint", "--format", "concise", str(project)]) == 3
    captured = capsys.readouterr()
    assert "deep.py:1:1: MP000 lint could not analyse this file (nested too deeply for the linter" in captured.out
    assert "could not analyse 2 files" in captured.err


def test_an_internal_error_in_a_rule_is_exit_3_not_findings(project, capsys, monkeypatch):
    def broken(script):
        raise KeyError("boom")

    monkeypatch.setattr(engine, "check", broken)
    (project / "train.py").write_text("import torch\n")
    assert main(["lint", "--format", "json", str(project / "train.py")]) == 3
    found = json.loads(capsys.readouterr().out)
    assert [(f["code"], f["internal"]) for f in found] == [("MP000", True)]
    assert "internal error: KeyError" in found[0]["message"]


def test_a_crash_outside_any_file_is_exit_3(project, capsys, monkeypatch):
    monkeypatch.setattr(engine.Project, "__init__", lambda self: (_ for _ in ()).throw(RuntimeError("boom")))
    (project / "train.py").write_text("import torch\n")
    assert main(["lint", str(project)]) == 3
    assert "internal error: RuntimeError" in capsys.readouterr().err


def test_a_syntax_error_is_still_a_problem_exit_1_and_json_has_no_internal_key(project, capsys):
    (project / "broken.py").write_text("def f(:\n")
    assert main(["lint", "--format", "json", str(project)]) == 1
    (found,) = json.loads(capsys.readouterr().out)
    assert found["code"] == "MP000" and "internal" not in found and "cell" not in found


# --- newer syntax ----------------------------------------------------------------------------


def test_a_syntax_error_names_the_python_that_could_not_parse_it():
    (found,) = lint_source("def f(:\n")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert found.code == "MP000" and f"with Python {version}" in found.message
    assert "may be valid on a newer Python" in found.message


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="PEP 701 f-strings parse from 3.12")
def test_a_pep_701_f_string_is_said_to_be_valid_from_python_3_12():
    (found,) = lint_source('x = f"{str(p / "checkpoints")}"\n')
    assert "Python 3.12" in found.message and "PEP 701" in found.message


# --- directories named like files -------------------------------------------------------------------


def test_a_directory_named_pkg_py_is_walked_not_read(project):
    (project / "pkg.py").mkdir()
    (project / "pkg.py" / "__init__.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    result = lint_paths([project])
    assert [(f.path.endswith("__init__.py"), f.code) for f in result.findings] == [(True, "MP201")]
    assert result.files == 1
    assert [f.code for f in lint_paths([project / "pkg.py"]).findings] == ["MP201"]


# --- notebooks -----------------------------------------------------------------------------------


def _notebook(*cells: tuple[str, str]) -> str:
    return json.dumps({"cells": [{"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True)}
                                 for kind, text in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def test_a_notebooks_code_cells_are_linted_and_placed_by_cell(project, capsys):
    path = project / "nb.ipynb"
    path.write_text(_notebook(("markdown", "# title\n"), ("code", "%pip install torch\n!nvidia-smi\n" + TRAPS)))
    assert main(["lint", "--format", "concise", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f'{path}:cell 2:4:10: MP201 torch.cuda.amp.GradScaler is deprecated; use torch.amp.GradScaler("cuda", ...)'
    assert out[1].startswith(f"{path}:cell 2:7:5: MP102")


def test_a_notebook_is_one_script_across_its_cells_with_magics_skipped():
    text = _notebook(
        ("code", "import torch\nscaler = torch.amp.GradScaler('cuda')\n"),
        ("code", "%%time\nfor x in loader:\n    with torch.autocast('cuda'):\n        loss = model(x)\n"
                 "    scaler.scale(loss).backward()\n    %time torch.nn.utils.clip_grad_norm_(p, 1.0)\n"
                 "    torch.nn.utils.clip_grad_norm_(p, 1.0)\n    scaler.step(opt)\n    scaler.update()\n"),
        ("code", "%%bash\nls -l\n"),
    )
    found = lint_source(text, "nb.ipynb")
    assert [(f.cell, f.line, f.code) for f in found] == [(2, 7, "MP101")]


def test_a_clean_notebook_and_a_directory_of_notebooks(project):
    (project / "nb.ipynb").write_text(_notebook(("code", "import torch\nx = torch.zeros(3)\n")))
    (project / "bad.ipynb").write_text(_notebook(("code", TRAPS)))
    (project / ".ipynb_checkpoints").mkdir()
    (project / ".ipynb_checkpoints" / "bad-checkpoint.ipynb").write_text(_notebook(("code", TRAPS)))
    result = lint_paths([project])
    assert result.files == 2
    assert sorted({(f.path.endswith("bad.ipynb"), f.code) for f in result.findings}) == [(True, "MP102"), (True, "MP201")]


def test_a_notebook_that_is_not_json_is_mp000_and_fix_leaves_notebooks_alone(project):
    (project / "broken.ipynb").write_text("{not json")
    (project / "nb.ipynb").write_text(_notebook(("code", TRAPS)))
    before = (project / "nb.ipynb").read_text()
    result = lint_paths([project], fix=True)
    assert (project / "nb.ipynb").read_text() == before and not result.fixed
    assert [f.message.split(":")[0] for f in result.findings if f.path.endswith("broken.ipynb")] == ["not a notebook"]
    assert not any(f.fixable for f in result.findings)


def test_a_notebook_cell_that_does_not_parse_is_left_out_and_the_others_checked():
    # real notebooks: shell commands continued with a backslash, a ``<your-api-key>`` placeholder
    text = _notebook(
        ("code", "!pip install \\\n    torch \\\n    accelerate\n"),
        ("code", "key = <your-api-key>\n"),
        ("code", TRAPS),
    )
    found = lint_source(text, "nb.ipynb")
    assert [(f.cell, f.line, f.code) for f in found] == [(2, 1, "MP000"), (3, 2, "MP201"), (3, 5, "MP102")]
    assert "this cell was left out" in found[0].message


def test_a_notebook_whose_only_problem_is_a_cell_that_does_not_parse_passes_with_a_note(project, capsys):
    # on real notebooks such cells are shell lines and placeholders, never Python: information, exit status 0
    (project / "nb.ipynb").write_text(_notebook(("code", "key = <your-api-key>\n"), ("code", "import torch\n")))
    assert main(["lint", "--format", "concise", str(project / "nb.ipynb")]) == 0
    out = capsys.readouterr().out
    assert "MP000 (info)" in out and "this cell was left out" in out
    assert main(["lint", "--format", "json", str(project / "nb.ipynb")]) == 0
    finding = json.loads(capsys.readouterr().out)[0]
    assert finding["severity"] == "info" and "note" not in finding
