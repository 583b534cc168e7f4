"""Every script in cases/ lints to exactly the findings its ``# expect: CODE`` comments name.

A case file marks each line that must be reported with ``# expect: MP101`` (several codes
separated by commas, one per finding); a file with no marks must lint clean. Files are named
``mpNNN_bad_*`` (flagged) and ``mpNNN_ok_*`` (near misses), plus the seeds' loops and
real-world shapes.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from mixprec.lint import RULES, lint_source

CASES = Path(__file__).parent / "cases"
CASE_FILES = sorted(CASES.rglob("*.py"))
_EXPECT = re.compile(r"#.*\bexpect:\s*([A-Z0-9,\s]+)$")


def expected(text: str) -> Counter:
    found: Counter = Counter()
    for number, line in enumerate(text.splitlines(), start=1):
        match = _EXPECT.search(line)
        if match:
            found.update((number, code.strip()) for code in match.group(1).split(",") if code.strip())
    return found


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: str(p.relative_to(CASES)))
def test_case_file_reports_exactly_its_expected_findings(path):
    text = path.read_text(encoding="utf-8")
    got = Counter((f.line, f.code) for f in lint_source(text, str(path)))
    assert got == expected(text)


@pytest.mark.parametrize("code", [c for c in RULES if c != "MP000"])
def test_every_rule_has_a_flagged_case_and_a_clean_near_miss(code):
    prefix = code.lower()
    flagged = [p for p in CASE_FILES if p.name.startswith(f"{prefix}_bad_")]
    near_misses = [p for p in CASE_FILES if p.name.startswith(f"{prefix}_ok_")]
    assert flagged and near_misses
    for path in flagged:
        assert any(c == code for _, c in expected(path.read_text())), path.name
    for path in near_misses:
        assert not any(c == code for _, c in expected(path.read_text())), path.name


def test_seed_loops_raise_nothing_but_the_deprecated_import():
    for path in sorted((CASES / "seeds").glob("*.py")):
        codes = {f.code for f in lint_source(path.read_text(), str(path))}
        assert codes <= {"MP201"}, (path.name, codes)
