"""The masters step benchmark runs and reports every recipe (a smoke test; the numbers are in BENCHMARKS.md)."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "masters_step.py"


def test_masters_step_benchmark_reports_each_recipe(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--layers", "3", "--width", "8", "--rounds", "2",
                                      "--steps-per-round", "1", "--recipes", "bf16-true", "bf16-true-kahan",
                                      "--json", str(out)])
    path = list(sys.path)
    try:
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        except SystemExit as e:
            assert e.code == 0
    finally:
        sys.path[:] = path
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bf16-mixed", "bf16-true", "bf16-true-kahan"]
    assert rows["bf16-mixed"]["tensors"] == 0 and rows["bf16-true-kahan"]["tensors"] == 3
    assert rows["bf16-true-kahan"]["masters_ms"] > 0 and rows["bf16-mixed"]["masters_ms"] == 0
    assert "| bf16-true-kahan | 3 |" in capsys.readouterr().out
