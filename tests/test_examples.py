"""The examples in examples/ run and do what they say."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("recipe", ["fp32", "fp16-mixed"])
def test_quickstart_trains(recipe, capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        quickstart = runpy.run_path(str(EXAMPLES / "quickstart.py"))
    finally:
        sys.path.remove(str(EXAMPLES))
    final = quickstart["main"](recipe, steps=40)
    out = capsys.readouterr().out
    assert f"recipe   {recipe}" in out and "->" in out
    assert final < 1.5  # ln(10) = 2.3 at the start: it learned
