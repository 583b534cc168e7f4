"""The command's terminal output: one row per dtype and output, folded to the console's width,
then each dtype's verdict and where it fails."""

from __future__ import annotations

from typing import Any

from mixprec.inference.check import InferenceReport, stat_cells

HEADERS = ["dtype", "output", "SQNR dB", "max|err|", "rel err", "top-1", "top-5", "verdict"]
_STYLE = {"agree": "green", "degraded": "yellow", "broken": "bold red"}


def rows(report: InferenceReport) -> list[list[str]]:
    out = []
    for r in report.results.values():
        outputs = r.outputs + ([r.overall] if r.overall is not None else [])
        if not outputs:  # the forward raised on the first batch
            out.append([r.dtype, "-", "-", "-", "-", "-", "-", _verdict(r.verdict)])
        for o in outputs:
            c = stat_cells(o)
            topk = next(v for k, v in c.items() if k.startswith("top-") and k != "top-1")
            verdict = r.verdict if o is r.overall or len(outputs) == 1 else ""
            out.append([r.dtype, o.name, c["SQNR dB"], c["max|err|"], c["rel err"], c["top-1"], topk,
                        _verdict(verdict) if verdict else ""])
    return out


def _verdict(v: str) -> str:
    return f"[{_STYLE[v]}]{v.upper()}[/]"


def print_report(report: InferenceReport, task: Any, console: Any, first: int) -> None:
    from rich.markup import escape

    from mixprec.report.terminal import fitted_tables

    title = f"{task.name}: fp32 vs 16-bit inference ({report.mode}), {report.batches} batches from step {first}"
    body = [[escape(c) if i == 1 else c for i, c in enumerate(row)] for row in rows(report)]
    for table in fitted_tables(HEADERS, body, console.width, title=title, keep=2,
                               justify={i: "right" for i in range(2, 7)}):
        console.print(table)
    if any(o.rows for r in report.results.values() for o in r.outputs):
        console.print("[dim]top-1: argmax agreement with fp32, a flip between classes fp32 scores within "
                      f"{report.thresholds.tie:.0%} of its row's range counted as agreeing (near-ties); top-5: "
                      "overlap of the top-5 sets[/dim]", highlight=False)
    for r in report.results.values():
        for i, line in enumerate(r.lines()):
            text = escape(line)
            if i == 0:
                v = r.verdict.upper()
                text = text.replace(v, f"[{_STYLE[r.verdict]}]{v}[/]", 1)
            console.print(text, highlight=False, soft_wrap=False)
    console.print(f"[dim]{escape(report.thresholds.describe())}[/dim]", highlight=False)
