"""The Python example of docs/compare.md's "--explain" section runs, and the figures it shows exist."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "compare.md"
SECTION = DOC.read_text(encoding="utf-8").split("## Why a recipe does not track: `--explain`", 1)[1]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)


def test_the_explain_section_has_its_example_and_it_runs():
    assert len(BLOCKS) == 1, "docs/compare.md's --explain section lost its python example"
    exec(compile(BLOCKS[0], "docs/compare.md (--explain)", "exec"), {"__name__": "__compare_doc__"})


def test_the_figures_the_section_shows_are_committed_pngs():
    images = re.findall(r"!\[[^\]]*\]\((images/[^)]+)\)", SECTION)
    assert len(images) == 2
    for rel in images:
        data = (DOC.parent / rel).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000, rel
