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
