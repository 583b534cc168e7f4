"""The mixprec command: help, unknown commands, 'recipes'."""

import json
import subprocess
import sys

import pytest
import torch

from mixprec_test_env import src_env
from mixprec.cli import main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: mixprec" in capsys.readouterr().out


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "recipes" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fly"])
    assert e.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_recipes_json_names_auto_and_its_reason(capsys):
    assert main(["recipes", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in data["recipes"]]
    assert {"fp32", "bf16-mixed", "fp16-mixed"} <= set(names)
    assert data["auto"]["recipe"] in names and data["auto"]["reason"].startswith("auto:")


def test_recipes_table_prints(capsys):
    assert main(["recipes", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fp16-mixed" in out and "auto ->" in out


def test_recipes_bad_device_exits_2(capsys):
    assert main(["recipes", "--device", "warp-drive"]) == 2
    captured = capsys.readouterr()
    assert "Unknown device" in captured.err and not captured.out  # stdout stays clean for --json pipes


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_recipes_on_missing_cuda_exits_2_with_one_line(capsys):
    assert main(["recipes", "--device", "cuda"]) == 2  # the example in 'mixprec recipes --help'
    err = capsys.readouterr().err
    assert err.startswith("error: 'auto' was asked for device 'cuda'") and "Traceback" not in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "mixprec", "--version"], capture_output=True, text=True, env=src_env())
    assert out.returncode == 0 and out.stdout.startswith("mixprec ")


def test_piped_tables_keep_whole_recipe_names():
    # piped (a file, a pager, CI), rich would assume 80 columns and cut names to "bf16-true-…"
    env = {k: v for k, v in src_env().items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "mixprec", "recipes"], capture_output=True, text=True, env=env,
                         check=True).stdout
    for name in ("bf16-true-kahan", "bf16-true-remainder", "bf16-true-sr"):
        assert f"│ {name} " in out
    assert "…" not in out


def test_make_console_width(monkeypatch):
    import io

    from mixprec.report.terminal import PIPED_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO()).width == PIPED_WIDTH
    assert make_console(file=io.StringIO(), width=70).width == 70
    monkeypatch.setenv("COLUMNS", "90")
    assert make_console(file=io.StringIO()).width == 90
