"""A self-contained HTML page: text, tables, preformatted blocks and PNGs embedded as base64."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em} h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0} td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3} pre{background:#f7f7f7;padding:.8em;overflow-x:auto}
.ok{color:#17803d;font-weight:600} .bad{color:#b42318;font-weight:600} .warn{color:#b54708;font-weight:600}
figure{margin:1em 0} figcaption{color:#555;font-size:.9em} img{max-width:100%}
"""


class HtmlReport:
    """Build a page piece by piece, then ``write(path)``. Every string is escaped.

    >>> page = HtmlReport("demo")
    >>> page.table(["a", "b"], [[1, 2]])
    >>> "<td>1</td>" in page.render()
    True
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self._parts: list[str] = []

    def heading(self, text: str, level: int = 2) -> None:
        self._parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str, css_class: str | None = None) -> None:
        cls = f' class="{css_class}"' if css_class else ""
        self._parts.append(f"<p{cls}>{html.escape(text)}</p>")

    def pre(self, text: str) -> None:
        self._parts.append(f"<pre>{html.escape(text)}</pre>")

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str | None] | None = None) -> None:
        """A table; ``classes[i]`` (e.g. "ok", "bad") styles row i."""
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
        body = []
        for i, row in enumerate(rows):
            cls = classes[i] if classes and i < len(classes) and classes[i] else None
            attr = f' class="{cls}"' if cls else ""
            body.append(f"<tr{attr}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
        self._parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")

    def image(self, png: bytes, caption: str = "", alt: str = "") -> None:
        data = base64.b64encode(png).decode("ascii")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(
            f'<figure><img alt="{html.escape(alt or caption)}" src="data:image/png;base64,{data}">{cap}</figure>'
        )

    def render(self) -> str:
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>{''.join(self._parts)}</body></html>"
        )

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(self.render(), encoding="utf-8")
        return p
