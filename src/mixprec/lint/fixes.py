"""Source positions and the application of edits for ``--fix``.

The AST gives columns as UTF-8 byte offsets; edits and reports use characters, so a line with
``é`` before the call is still rewritten at the right place.
"""

from __future__ import annotations

import ast
import io
import os
import stat
import uuid

from mixprec.lint.report import Edit


class Source:
    """One file's text, with (line, byte column) -> character offset."""

    def __init__(self, text: str):
        self.text = text
        # StringIO(newline="") splits on \n, \r\n and \r only, like Python's tokenizer.
        self.lines = io.StringIO(text, newline="").readlines()
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        if lineno > len(self.lines):
            return len(self.text)
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def column(self, node: ast.AST) -> int:
        """1-based character column of ``node``'s start."""
        return self.offset(node.lineno, node.col_offset) - self.starts[node.lineno - 1] + 1

    def open_paren(self, call: ast.Call) -> int | None:
        """Offset just after the ``(`` of ``call``; None when anything but spaces precedes it."""
        after = self.span(call.func)[1]
        i = after
        while i < len(self.text) and self.text[i] in " \t":
            i += 1
        return i + 1 if i < len(self.text) and self.text[i] == "(" else None


def apply_edits(text: str, groups: list[tuple[Edit, ...]]) -> tuple[str, int]:
    """Apply each group of edits whole, skipping a group that overlaps one already taken.

    Returns the new text and the number of groups applied. Identical edits shared by two
    groups (one import line serving several calls) are applied once.
    """
    taken: dict[tuple[int, int, str], int] = {}  # edit -> the order it was taken in
    applied = 0
    for group in sorted(groups, key=lambda g: min(e.start for e in g)):
        new = [e for e in group if (e.start, e.end, e.new) not in taken]
        if any(_overlap(e, Edit(*t)) for e in new for t in taken):
            continue
        for e in new:
            taken[(e.start, e.end, e.new)] = len(taken)
        applied += 1
    out = text
    # From the end backwards; two insertions at one point keep the order they were listed in.
    for start, end, replacement in sorted(taken, key=lambda e: (e[0], e[1], taken[e]), reverse=True):
        out = out[:start] + replacement + out[end:]
    return out, applied


def _overlap(a: Edit, b: Edit) -> bool:
    """Spans that share text, or two insertions at one point (their order would be a guess)."""
    if a.start == a.end or b.start == b.end:
        point, other = (a, b) if a.start == a.end else (b, a)
        return other.start < point.start < other.end or (other.start == other.end == point.start)
    return a.start < b.end and b.start < a.end


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Replace the file at ``path`` with ``data`` as one step: written in full and flushed under a temporary
    name beside it, given the old file's permission bits, then renamed over it. A crash, a full disk or a
    Ctrl-C part-way leaves the user's file as it was (and no temporary file), never half a script. A
    symlink stays a symlink: the file it points to is the one replaced."""
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
