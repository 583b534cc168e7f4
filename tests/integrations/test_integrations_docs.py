"""Every python example in docs/integrations.md runs (each needs the frameworks its first line names)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _needs(code: str) -> list[str]:
    first = code.splitlines()[0]
    match = re.fullmatch(r"# needs: (.*)", first)
    assert match, f"an example in {DOC.name} must say what it needs on its first line: {first!r}"
    return [name.strip() for name in match.group(1).split(",")]


def test_every_integration_has_an_example():
    needs = [n for code in BLOCKS for n in _needs(code)]
    assert {"lightning", "transformers", "accelerate", "tensorboard"} <= set(needs)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[", ".join(_needs(c)) for c in BLOCKS])
def test_docs_example_runs(index, tmp_path, monkeypatch, capsys):
    code = BLOCKS[index]
    for name in _needs(code):
        pytest.importorskip(name, reason=f"{name} is not installed (the example needs it)")
    monkeypatch.chdir(tmp_path)  # examples that write (output_dir=...) write here
    exec(compile(code, f"{DOC.name} example {index}", "exec"), {"__name__": "__docs__"})
    out = capsys.readouterr().out
    assert out.strip(), "the example prints what it did"
