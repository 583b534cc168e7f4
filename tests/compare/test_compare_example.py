"""The documented example task works, from Python and from the command line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mixprec.cli import main
from mixprec.tasks import load_task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "compare_custom_task.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("compare_custom_task", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_factory_follows_the_protocol(example):
    task = load_task(example.make_task, steps=12, width=8)
    assert task.name == "spirals" and task.steps == 12
    x, y = task.get_batch(3)
    x2, y2 = task.get_batch(3)
    assert x.shape == (128, 2) and y.shape == (128,) and (x == x2).all() and (y == y2).all()


def test_example_main_tracks_and_writes_a_report(example, tmp_path, capsys):
    code = example.main(steps=30, out=str(tmp_path / "r"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bf16-mixed" in out and "TRACKS" in out
    assert (tmp_path / "r" / "compare.html").is_file()


def test_example_runs_from_the_command_line_by_module_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the documented way: from the repository root
    code = main(["compare", "--task", "examples.compare_custom_task:make_task", "--task-arg", "width=16",
                 "--recipes", "bf16-mixed", "--steps", "20", "--quiet", "--out", str(tmp_path / "r")])
    assert code == 0, capsys.readouterr()
