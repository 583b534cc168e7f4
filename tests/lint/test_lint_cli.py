"""`mixprec lint` on the command line: output, exit codes, options, config, and no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mixprec.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"

CLIP_BEFORE_UNSCALE = textwrap.dedent(
    """\
    import torch
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    """
)
CLEAN = "import torch\nx = torch.zeros(3)\n"
DEPRECATED = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A directory with no pyproject.toml above it that matters: the cwd is the tmp dir."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return tmp_path


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_findings_print_path_line_col_code_and_exit_1(project, capsys):
    path = write(project, "train.py", CLIP_BEFORE_UNSCALE)
    assert main(["lint", "--format", "concise", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}:6:1: MP101 gradients clipped while still scaled")
    assert lines[-1] == "1 problem in 1 file"


def test_default_text_format_explains_why_and_fix(project, capsys):
    path = write(project, "train.py", CLIP_BEFORE_UNSCALE)
    main(["lint", str(path)])
    out = capsys.readouterr().out
    assert "    why: Gradients are still multiplied by the loss scale" in out
    assert "    fix: Call scaler.unscale_(optimizer)" in out


def test_clean_files_exit_0(project, capsys):
    write(project, "a.py", CLEAN)
    assert main(["lint", str(project)]) == 0
    assert capsys.readouterr().out.strip() == "no problems in 1 file"


def test_json_format_is_a_list_of_objects(project, capsys):
    path = write(project, "train.py", CLIP_BEFORE_UNSCALE)
    assert main(["lint", "--format", "json", str(path)]) == 1
    (item,) = json.loads(capsys.readouterr().out)
    assert item["code"] == "MP101" and item["line"] == 6 and item["col"] == 1
    assert item["path"] == str(path) and item["name"] == "clip-before-unscale"
    assert item["why"] and item["fix"] and item["fixable"] is False


def test_select_and_ignore_filter_by_code_or_prefix(project, capsys):
    path = write(project, "train.py", CLIP_BEFORE_UNSCALE + DEPRECATED.split("\n", 1)[1])
    assert main(["lint", "--format", "concise", "--select", "MP2", str(path)]) == 1
    assert [l.split()[1] for l in capsys.readouterr().out.splitlines()[:-1]] == ["MP201"]
    assert main(["lint", "--format", "concise", "--ignore", "MP101,MP201", str(path)]) == 0


def test_unknown_rule_code_is_a_usage_error(project, capsys):
    path = write(project, "train.py", CLEAN)
    assert main(["lint", "--ignore", "MP999", str(path)]) == 2
    assert "Unknown rule code 'MP999'" in capsys.readouterr().err


def test_unknown_code_in_select_names_the_option_not_the_config_file(project, capsys):
    path = write(project, "train.py", CLEAN)
    assert main(["lint", "--select", "MP999", str(path)]) == 2
    assert "Unknown rule code 'MP999' in --select;" in capsys.readouterr().err
    (project / "pyproject.toml").write_text('[tool.mixprec.lint]\nselect = ["MP9"]\n')
    assert main(["lint", str(path)]) == 2
    assert f"Unknown rule code 'MP9' in {project / 'pyproject.toml'};" in capsys.readouterr().err


def test_missing_path_is_a_usage_error(project, capsys):
    assert main(["lint", "nope.py"]) == 2
    assert "no such file or directory: nope.py" in capsys.readouterr().err


def test_no_path_is_a_usage_error(project):
    assert main(["lint"]) == 2


def test_unparsable_file_is_reported_and_the_rest_still_linted(project, capsys):
    write(project, "broken.py", "def f(:\n")
    write(project, "train.py", CLIP_BEFORE_UNSCALE)
    assert main(["lint", "--format", "concise", str(project)]) == 1
    out = capsys.readouterr().out
    assert "broken.py:1:7: MP000 syntax error" in out
    assert "train.py:6:1: MP101" in out
    assert out.splitlines()[-1] == "2 problems in 2 files"


def test_directories_skip_hidden_venv_build_and_cache_dirs(project, capsys):
    for skipped in (".git/x.py", ".venv/lib/x.py", "venv/x.py", "build/x.py", "__pycache__/x.py", "sub/.hidden/x.py"):
        write(project, skipped, DEPRECATED)
    write(project, "sub/train.py", DEPRECATED)
    write(project, "notes.txt", DEPRECATED)
    assert main(["lint", "--format", "concise", str(project)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in out[:-1]] == [str(project / "sub" / "train.py")]


def test_pyproject_config_selects_ignores_and_excludes(project, capsys):
    (project / "pyproject.toml").write_text(
        '[tool.mixprec.lint]\nignore = ["MP201"]\nexclude = ["*/legacy/*"]\n'
    )
    write(project, "train.py", DEPRECATED)
    write(project, "legacy/old.py", CLIP_BEFORE_UNSCALE)
    assert main(["lint", str(project)]) == 0
    assert main(["lint", "--format", "concise", "--select", "MP201", str(project / "train.py")]) == 0  # ignore still applies
    capsys.readouterr()


def test_explicit_config_file_and_bad_config_keys(project, capsys):
    config = write(project, "conf/lint.toml", '[tool.mixprec.lint]\nselect = ["MP1"]\n')
    path = write(project, "train.py", DEPRECATED)
    assert main(["lint", "--config", str(config), str(path)]) == 0
    write(project, "conf/bad.toml", '[tool.mixprec.lint]\nselcet = ["MP1"]\n')
    assert main(["lint", "--config", str(project / "conf/bad.toml"), str(path)]) == 2
    assert "Unknown key 'selcet'" in capsys.readouterr().err


def test_fix_rewrites_files_and_reports_what_it_fixed(project, capsys):
    path = write(project, "train.py", DEPRECATED)
    assert main(["lint", "--fix", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: fixed 1 problem" in out
    assert path.read_text() == 'import torch\nscaler = torch.amp.GradScaler("cuda")\n'


def test_summary_counts_fixable_findings(project, capsys):
    path = write(project, "train.py", DEPRECATED)
    main(["lint", str(path)])
    assert capsys.readouterr().out.splitlines()[-1] == "1 problem in 1 file (1 fixable with --fix)"


def test_explain_prints_why_and_fix(capsys):
    assert main(["lint", "--explain", "mp201"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MP201 deprecated-amp-api (fixable with --fix)")
    assert "Why:" in out and "Fix:" in out
    assert main(["lint", "--explain", "MP999"]) == 2


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def test_python_dash_m_mixprec_lint_exit_codes(tmp_path):
    bad = write(tmp_path, "bad.py", CLIP_BEFORE_UNSCALE)
    good = write(tmp_path, "good.py", CLEAN)
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "mixprec", "lint", *args], capture_output=True, text=True, env=_env(), cwd=tmp_path
    )
    assert run(str(good)).returncode == 0
    result = run(str(bad))
    assert result.returncode == 1 and "MP101" in result.stdout
    assert run(str(tmp_path / "missing.py")).returncode == 2


def test_lint_never_imports_torch(tmp_path):
    bad = write(tmp_path, "bad.py", CLIP_BEFORE_UNSCALE + DEPRECATED)
    code = (
        "import sys\n"
        "from mixprec.cli import main\n"
        f"rc = main(['lint', '--fix', {str(bad)!r}])\n"
        "assert rc == 1, rc\n"
        "assert 'torch' not in sys.modules, 'mixprec lint imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr


def test_unreadable_and_null_byte_files_are_reported_not_crashed_on(project, capsys):
    (project / "latin.py").write_bytes(b"x = '\xff\xfe'\n")
    (project / "nul.py").write_bytes(b"x = 1\x00\n")
    write(project, "train.py", CLEAN)
    assert main(["lint", "--format", "concise", str(project)]) == 1
    out = capsys.readouterr().out
    assert "latin.py:1:1: MP000 cannot read the file" in out
    assert "nul.py:1:1: MP000 syntax error" in out
    assert out.splitlines()[-1] == "2 problems in 2 files (3 checked)"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_output_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path, fmt):
    # ``mixprec lint . | head -1``: head closes the pipe after one line; no traceback after that
    many = "import torch\n" + "s = torch.cuda.amp.GradScaler()\n" * 1000  # some 400 kB: far more than a pipe buffer
    write(tmp_path, "many.py", many)
    process = subprocess.Popen(
        [sys.executable, "-m", "mixprec", "lint", "--format", fmt, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path,
    )
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.wait(timeout=60)
    assert first
    assert stderr == ""
    assert process.returncode == 1  # findings were found, as without the pipe


SCHEDULER_AFTER_STEP = textwrap.dedent(
    """\
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    """
)


def test_an_info_note_is_printed_but_does_not_fail_the_run(project, capsys):
    (project / "train.py").write_text(SCHEDULER_AFTER_STEP)
    assert main(["lint", "train.py", "--format", "concise"]) == 0
    out = capsys.readouterr().out
    assert "train.py:9:5: MP120 (info) sched.step() runs even when scaler.step()" in out
    assert "no problems in 1 file, 1 note (info)" in out
    assert main(["lint", "train.py", "--format", "json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)
    assert finding["code"] == "MP120" and finding["severity"] == "info"


def test_a_problem_next_to_a_note_still_fails_the_run(project, capsys):
    (project / "train.py").write_text(SCHEDULER_AFTER_STEP.replace("scaler.scale(loss).backward()\n",
                                                                   "scaler.scale(loss).backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"))
    assert main(["lint", "train.py", "--format", "concise"]) == 1
    assert "1 problem in 1 file, 1 note (info)" in capsys.readouterr().out
