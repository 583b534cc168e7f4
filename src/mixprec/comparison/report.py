"""The files and the terminal summary of ``mixprec compare``.

Four files go into the output directory: ``compare.html`` (self-contained: plots, verdicts, the
rule), ``compare.png`` (the figure), ``compare.json`` (everything, curves included) and
``compare.csv`` (one row per run and step). A directory already holding files of those names is
only written into when its ``compare.json`` came from ``mixprec compare``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from mixprec.report.publish import publish_files
from mixprec.comparison.verdict import ema
from mixprec.instruments.machine import describe
from mixprec.report.outdir import check_writable_dir

FILES = {"html": "compare.html", "png": "compare.png", "json": "compare.json", "csv": "compare.csv"}
DEFAULT_OUT = "mixprec-report/compare"


def check_out_dir(out: str | Path) -> Path:
    """Refuse to overwrite files that an earlier ``mixprec compare`` did not write. Call before training."""
    path = check_writable_dir(out)
    clashes = [name for name in FILES.values() if (path / name).exists()]
    if clashes and not _written_by_compare(path / FILES["json"]):
        raise FileExistsError(
            f"{str(path)!r} already holds {', '.join(clashes)}, not written by 'mixprec compare' (no "
            f"{FILES['json']} of ours beside them); choose another --out or move those files"
        )
    return path


def _written_by_compare(path: Path) -> bool:
    try:
        return "mixprec_compare" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _tail_mean(loss: np.ndarray, n: int = 10) -> float:
    """The mean of the last ``n`` finite losses: one noisy batch should not be 'the final loss'."""
    finite = loss[np.isfinite(loss)]
    return float(finite[-n:].mean()) if len(finite) else float("nan")


def summary_rows(result: Any) -> list[dict[str, Any]]:
    """One row per seed-0 run (fp32 reference first): what the table, HTML and JSON show."""
    rows = []
    for run in (r for r in result.runs if r.role != "noise"):
        verdict = result.verdicts.get(run.recipe)
        rows.append({
            "recipe": run.recipe,
            "verdict": "reference" if run.role == "reference" else verdict.status if verdict else "-",
            "ok": run.role == "reference" or bool(verdict and verdict.ok),
            "from_step": verdict.first_step if verdict else None,
            "ratio": verdict.ratio if verdict else None,
            "final_loss": _tail_mean(run.loss),
            # the fp32 row shows the baseline the ratios divide by: the interleaved rounds' median, else
            # all fp32 seeds pooled
            "step_ms": _step_ms(result, run),
            "speedup": result.speedup(run.recipe),
            "speedup_ci": (lambda r: None if r is None else (r["ci95_low"], r["ci95_high"]))(result.speed_interval(run.recipe)),
            "skipped": run.skipped_steps if run.loss_scaling != "none" else None,
            "peak_mib": None if run.peak_memory_bytes is None else run.peak_memory_bytes / 2**20,
            "message": verdict.message if verdict else "the reference: fp32 from seed 0",
        })
    ran = {r["recipe"] for r in rows}
    for name, verdict in result.verdicts.items():  # recipes that never ran (fp32 itself failed): say why
        if name not in ran:
            rows.append({
                "recipe": name, "verdict": verdict.status, "ok": verdict.ok, "from_step": verdict.first_step,
                "ratio": None, "final_loss": None, "step_ms": None, "speedup": None, "skipped": None,
                "peak_mib": None, "message": f"not run: {verdict.message}",
            })
    return rows


def _step_ms(result: Any, run: Any) -> float:
    timing = getattr(result, "timing", None) or {}
    if run.recipe in timing:
        return float(np.median(timing[run.recipe])) * 1e3
    return (result.fp32_step_s if run.role == "reference" else run.median_step_s) * 1e3


def speedup_note(result: Any) -> str:
    """The one speed convention of every mixprec table, and how this comparison measured it."""
    head = "speedup = fp32's step time / this recipe's (> 1: faster than fp32)"
    if getattr(result, "speed_method", "sequential") == "interleaved":
        rounds = len(next(iter(result.timing.values())))
        return (f"{head}: the median of {rounds} interleaved rounds (each recipe's step once per round, the order "
                "rotated), 95% interval in brackets; step ms: the rounds' median")
    return (f"{head}; INDICATIVE ONLY: the runs went one after another, so load that changed between them moves "
            "it (rerun without --timing-rounds 0, or use 'mixprec bench', which interleaves)")


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return missing
    return format(value, spec)


_HEADERS = ["recipe", "verdict", "gap/band", "last-10 loss", "step ms", "speedup", "skipped", "peak MiB"]


def _cells(row: dict[str, Any]) -> list[str]:
    verdict = row["verdict"] + (f" @{row['from_step']}" if row["from_step"] is not None else "")
    return [
        row["recipe"], verdict, _fmt(row["ratio"], ".2f"), _fmt(row["final_loss"], ".5g"),
        _fmt(row["step_ms"], ".1f"), _speed_cell(row), _fmt(row["skipped"], "d"),
        _fmt(row["peak_mib"], ".1f", "n/a"),
    ]


def _speed_cell(row: dict[str, Any]) -> str:
    if row["speedup"] is None:
        return "-"
    ci = row.get("speedup_ci")
    return _fmt(row["speedup"], ".2f") + "x" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci and row["recipe"] != "fp32" else "")


def _machine(result: Any) -> str:
    """The machine as the runs saw it (their thread count: compare restores the caller's after; the JAX
    result describes jax's devices)."""
    return describe(result.machine())


def print_summary(result: Any, console: Any = None) -> None:
    """The terminal summary: a rich table of verdicts, then one line per recipe and the rule."""
    from rich.table import Table

    from mixprec.report.terminal import make_console

    console = console or make_console()
    rows = summary_rows(result)
    # peak memory is measured on CUDA only; a column of n/a says nothing
    ncols = len(_HEADERS) if any(r["peak_mib"] is not None for r in rows) else len(_HEADERS) - 1
    table = Table(title=f"mixprec compare: {result.task} on {result.device}, {result.steps} steps, "
                        f"{len(result.noise)} extra fp32 seeds, {result.wall_s:.0f} s")
    for h in _HEADERS[:ncols]:
        table.add_column(h, justify="left" if h in ("recipe", "verdict") else "right", no_wrap=h in ("recipe", "verdict"))
    for row in rows:
        style = None if row["verdict"] == "reference" else "green" if row["ok"] else "bold red"
        table.add_row(*_cells(row)[:ncols], style=style)
    console.print(table)
    for row in rows[1:]:
        mark = "[green]ok[/green]" if row["ok"] else "[bold red]FAIL[/bold red]"
        console.print(f"  {mark} [bold]{row['recipe']}[/bold] {row['verdict']}: {row['message']}", highlight=False)
    console.print(f"[dim]rule: {result.rule.summary(result.steps)}[/dim]", highlight=False)
    console.print(f"[dim]{speedup_note(result)}; machine: {_machine(result)}[/dim]", highlight=False)
    if result.files:
        console.print(f"report: {result.files['html']}  (data: {result.files['json']}, {result.files['csv']})")


def _threads(data: dict[str, Any]) -> str:
    return "XLA sizes its own CPU threads" if data.get("backend") == "jax" else f"torch threads {data['threads']}"


def write_report(result: Any, out: str | Path) -> dict[str, str]:
    """Write the four files into ``out`` (created if missing) as one set; return name -> path.

    Every file is rendered and written aside first, then renamed into place with the JSON last
    (``mixprec.report.publish``): an interrupted or failing write leaves the earlier report whole.
    """
    from mixprec.report import figure_to_png
    from mixprec.report.compare_plots import comparison_figure

    path = check_out_dir(out)
    path.mkdir(parents=True, exist_ok=True)
    files = {key: str(path / name) for key, name in FILES.items()}
    result = dataclasses.replace(result, files=files)  # the JSON lists the files; the caller's object is untouched
    span = result.rule.resolve(result.steps).span
    png = figure_to_png(comparison_figure(result, lambda x: ema(x, span), f"EMA span {span}"))
    publish_files(path, {FILES["png"]: png, FILES["csv"]: _csv_text(result), FILES["html"]: _html_page(result, png),
                         FILES["json"]: result.to_json()}, last=FILES["json"])
    return files


def _csv_text(result: Any) -> str:
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow(["run", "recipe", "seed", "role", "step", "loss", "grad_norm", "scale", "skipped", "step_time_s"])
    for r in result.runs:
        for i in range(r.steps):
            w.writerow([r.label, r.recipe, r.seed, r.role, i + 1, repr(float(r.loss[i])), repr(float(r.grad_norm[i])),
                        repr(float(r.scale[i])), int(bool(r.skipped[i])), repr(float(r.step_time_s[i]))])
    return f.getvalue()


def _html_page(result: Any, png: bytes) -> str:
    from mixprec.report import HtmlReport

    page = HtmlReport(f"mixprec compare: {result.task}")
    failed = [v for v in result.verdicts.values() if not v.ok]
    if failed:
        page.paragraph(
            "FAIL: " + "; ".join(f"{v.recipe} {v.status}" for v in failed) + ". Details below.", css_class="bad"
        )
        for why in dict.fromkeys(v.message for v in failed if v.status == "UNJUDGED"):
            page.paragraph(why, css_class="bad")  # fp32 itself failed: the reason, up front
    else:
        page.paragraph("OK: every recipe tracks fp32 within fp32's own seed-to-seed noise.", css_class="ok")
    rows = summary_rows(result)
    page.table(_HEADERS + ["why"], [_cells(r) + [r["message"]] for r in rows],
               classes=[None if r["verdict"] == "reference" else "ok" if r["ok"] else "bad" for r in rows])
    page.paragraph(f"{speedup_note(result)}. Machine: {_machine(result)}.",
                   css_class=None if getattr(result, "speed_method", "") == "interleaved" else "bad")
    page.image(png, caption=(
        "Top: smoothed loss of each recipe over the shaded fp32 noise band (raw losses faint). "
        "Bottom: the loss scale of recipes with a scaler, triangles at skipped steps."
    ))
    page.heading("The rule")
    page.paragraph(result.rule.describe(result.steps))
    page.heading("Runs")
    page.table(
        ["run", "recipe", "policy", "loss scaling", "seed", "steps", "final loss", "median step ms", "wall s", "note"],
        [[r.label, r.recipe, r.policy, r.loss_scaling, r.seed, f"{r.steps}/{r.steps_requested}",
          _fmt(_tail_mean(r.loss), ".5g"), _fmt(r.median_step_s * 1e3, ".1f"), f"{r.wall_s:.1f}",
          r.error or r.stopped or ""] for r in result.runs],
    )
    scaled = [v for v in result.verdicts.values() if v.scale]
    if scaled:
        page.heading("Loss scale")
        page.pre("\n".join(f"{v.recipe}: " + ", ".join(f"{k}={val}" for k, val in v.scale.items()) for v in scaled))
    page.heading("Setup")
    data = result.to_dict()
    page.pre(
        f"task        {result.task}: {result.description}\n"
        f"device      {result.device} ({_threads(data)})\n"
        f"steps       {result.steps} per run; fp32 seeds 0 (reference) and "
        f"{', '.join(str(r.seed) for r in result.noise)} (noise); every recipe from seed 0\n"
        f"seeds vary  the initial weights only: every run sees the same batches\n"
        f"versions    mixprec {data['mixprec']}, torch {data['torch']}, python {data['python']}"
        + (f", jax {data['jax']}, jaxlib {data['jaxlib']}, optax {data['optax']}" if data.get("backend") == "jax" else "")
        + "\n"
        f"wall time   {result.wall_s:.1f} s\n"
        f"data        {FILES['json']} (all curves), {FILES['csv']} (one row per run and step)"
    )
    return page.render()
