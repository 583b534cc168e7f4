"""Jupyter notebooks: the code cells of an ``.ipynb`` file read as one Python script.

A notebook is JSON, and JSON happens to parse as a Python dict expression: linted as Python, a
notebook full of traps came out "no problems" (found by a probe of real scripts). Its code cells
are joined in order, as the kernel runs them top to bottom, so that a scaler made in one cell and
stepped in another is one object; IPython's own syntax (``%magic`` and ``!shell`` lines, ``%%``
cell magics) becomes ``pass`` on the same line so that line numbers stay put. A finding is then
placed by the cell that holds it (1-based position among all the notebook's cells, markdown
included, as an editor shows it) and the line inside that cell.

    >>> cells = notebook_code('{"cells": [{"cell_type": "code", "source": ["%pip install x\\\\n", "y = 1"]}]}')
    >>> cells.text
    'pass\\ny = 1\\n'
    >>> cells.place(2)
    (1, 2)
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass, field

# ``%%time`` and the like run the rest of the cell as Python; other cell magics (``%%bash``,
# ``%%writefile``) hold something else, and the whole cell is left out.
_PYTHON_CELL_MAGICS = frozenset({"time", "timeit", "capture", "prun", "debug"})
_IPYTHON_LINE = re.compile(r"^(\s*)(?:[%!]|\w+\s*=\s*[%!])")  # %magic, !shell, x = !ls


@dataclass
class NotebookCode:
    """The code cells as one text, and where each of its lines comes from."""

    text: str = ""
    origin: list[tuple[int, int]] = field(default_factory=list)  # [line - 1] -> (cell, line in cell)
    broken: list[tuple[int, SyntaxError]] = field(default_factory=list)  # (cell, its error): left out

    def place(self, line: int) -> tuple[int, int]:
        """(cell number, line in that cell) of a 1-based line of ``text``."""
        if 1 <= line <= len(self.origin):
            return self.origin[line - 1]
        return self.origin[-1] if self.origin else (1, line)


def is_notebook(path: str | None) -> bool:
    return bool(path) and str(path).endswith(".ipynb")


def notebook_code(raw: str) -> NotebookCode:
    """The code of a notebook's JSON text. Raises ValueError when it is no notebook."""
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"not a notebook: invalid JSON ({error})") from None
    cells = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a notebook: no list of cells")
    code = NotebookCode()
    lines: list[str] = []
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else str(source)
        python = _python_lines(text.splitlines())
        error = _parse_error("".join(f"{line}\n" for line in python))
        if error is not None:
            # the kernel compiles each cell on its own: one that does not parse (shell commands, a
            # ``<your-api-key>`` placeholder) is left out and reported, the others still checked
            code.broken.append((number, error))
            python = ["" for _ in python]
        for index, line in enumerate(python, start=1):
            lines.append(line)
            code.origin.append((number, index))
    code.text = "".join(f"{line}\n" for line in lines)
    return code


def _parse_error(text: str) -> SyntaxError | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            ast.parse(text)
    except SyntaxError as error:
        return error
    except (ValueError, RecursionError, MemoryError) as error:
        return SyntaxError(f"{type(error).__name__}: {error}", (None, 1, 1, ""))
    return None


def _python_lines(lines: list[str]) -> list[str]:
    """The lines of one cell with IPython's syntax replaced by ``pass`` (same indentation), and
    the lines a magic or shell command continues onto with a backslash by blank lines."""
    if lines and lines[0].lstrip().startswith("%%"):
        magic = lines[0].lstrip()[2:].split(maxsplit=1)
        keep = bool(magic) and magic[0] in _PYTHON_CELL_MAGICS
        return ["pass"] + (_python_lines(lines[1:]) if keep else ["" for _ in lines[1:]])
    out, continued = [], False
    for line in lines:
        match = None if continued else _IPYTHON_LINE.match(line)
        if continued:
            out.append("")
        else:
            out.append(f"{match.group(1)}pass" if match else line)
        continued = (continued or match is not None) and line.rstrip().endswith("\\")
    return out
