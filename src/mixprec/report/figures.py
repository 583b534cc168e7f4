"""matplotlib without a display: make figures, turn them into PNG bytes or files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 8.0, height: float = 4.5, dpi: int = 100, **kw: Any):
    """A (figure, axes) pair of ``width x height`` inches at ``dpi`` (pixels = inches * dpi)."""
    plt = _pyplot()
    return plt.subplots(nrows, ncols, figsize=(width, height), dpi=dpi, **kw)


def figure_to_png(fig) -> bytes:
    """PNG bytes of a figure (closed afterwards, so figures do not pile up in memory)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi)
    _pyplot().close(fig)
    return buf.getvalue()


def save_png(fig, path: str | Path) -> bytes:
    """Write the figure to ``path`` as PNG and return the bytes (for embedding in HTML too)."""
    data = figure_to_png(fig)
    Path(path).write_bytes(data)
    return data
