"""The runnable example in docs/masters.md runs."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "masters.md"


def test_docs_example_trains_with_bf16_true(capsys):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {})
    assert "masters  fp32: fp32 master copy" in capsys.readouterr().out
