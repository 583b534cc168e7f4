"""The rich console the commands print with.

On a terminal rich fits its width. Piped into a file, a pager or a CI log, rich assumes 80 columns
and cuts table cells (recipe names among them) with an ellipsis; there the console is 120 wide
unless ``COLUMNS`` says otherwise.
"""

from __future__ import annotations

import os
from typing import Any

PIPED_WIDTH = 120


def make_console(**kwargs: Any) -> Any:
    """A ``rich.console.Console``; ``PIPED_WIDTH`` columns when not writing to a terminal."""
    from rich.console import Console

    console = Console(**kwargs)
    if not console.is_terminal and "COLUMNS" not in os.environ and "width" not in kwargs:
        console = Console(width=PIPED_WIDTH, **kwargs)
    return console


def _cell_width(text: str) -> int:
    from rich.text import Text

    return max((Text.from_markup(line).cell_len for line in str(text).splitlines()), default=0)


def column_groups(headers: list[str], rows: list[list[str]], width: int, keep: int = 1) -> list[list[int]]:
    """Column indices for tables that each fit ``width`` with no cell wrapped or cut: the first
    ``keep`` columns (the row labels) start every group, the others follow in order, as many per
    group as fit. A column too wide for any group gets one of its own."""
    widths = [max([_cell_width(h)] + [_cell_width(r[i]) for r in rows if i < len(r)]) for i, h in enumerate(headers)]
    # rich's default box: one border per column plus one, and one space of padding either side
    fixed = 1 + sum(w + 3 for w in widths[:keep])
    groups: list[list[int]] = []
    current: list[int] = []
    used = fixed
    for i in range(keep, len(headers)):
        need = widths[i] + 3
        if current and used + need > width:
            groups.append(current)
            current, used = [], fixed
        current.append(i)
        used += need
    if current or not groups:
        groups.append(current)
    return [list(range(keep)) + g for g in groups]


def fitted_tables(headers: list[str], rows: list[list[str]], width: int, *, title: str | None = None,
                  caption: str | None = None, keep: int = 1, justify: dict[int, str] | None = None) -> list[Any]:
    """``rich`` tables holding ``rows`` that fit ``width`` columns: the columns are folded into as
    many tables as needed (each repeating the ``keep`` label columns) instead of wrapping every
    cell or cutting names with an ellipsis. ``justify`` maps a column index to "right"/"left"."""
    from rich.table import Table

    groups = column_groups(headers, rows, width, keep)
    tables = []
    for n, cols in enumerate(groups):
        suffix = f" ({n + 1}/{len(groups)})" if len(groups) > 1 and title else ""
        table = Table(title=(title + suffix) if title else None,
                      caption=caption if n == len(groups) - 1 else None)
        for i in cols:
            table.add_column(headers[i], no_wrap=True, justify=(justify or {}).get(i, "left"))
        for r in rows:
            table.add_row(*[r[i] if i < len(r) else "" for i in cols])
        tables.append(table)
    return tables
