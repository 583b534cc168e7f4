"""The ```python blocks of docs/diagnostics.md's NaN guard section run as written."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "diagnostics.md"
SECTION = DOC.read_text().split("## The NaN guard", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)


def test_the_guard_section_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guard_doc_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"docs/diagnostics.md guard block {index}", "exec"), {"__name__": "__doc__"})
    out = capsys.readouterr().out
    assert "produced in" in out  # each example prints the event it found
