"""The files of ``mixprec compare --explain``: explain.html (self-contained), explain.png (the
figure of ``mixprec.report.explain_plots``) and explain.json (everything). A directory already
holding files of those names is only written into when its explain.json came from explain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixprec.report.publish import publish_files
from mixprec.comparison.verdict import ema
from mixprec.report.outdir import check_writable_dir

FILES = {"html": "explain.html", "png": "explain.png", "json": "explain.json"}


def check_explain_dir(out: str | Path) -> Path:
    """Refuse to overwrite explain files that explain did not write. Call before training."""
    path = check_writable_dir(out)
    clashes = [n for n in FILES.values() if (path / n).exists()]
    if clashes and not _ours(path / FILES["json"]):
        raise FileExistsError(f"{str(path)!r} already holds {', '.join(clashes)}, not written by 'mixprec compare "
                              "--explain'; choose another --out or move those files")
    return path


def _ours(path: Path) -> bool:
    try:
        return "mixprec_explain" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def write_explanation(e: Any, out: str | Path) -> dict[str, str]:
    """Write the files (PNG only when modules were measured) as one set, the JSON renamed into place last
    (``mixprec.report.publish``: an interrupted write leaves the earlier files whole); returns name -> path."""
    from mixprec.report import HtmlReport, figure_to_png

    path = check_explain_dir(out)
    path.mkdir(parents=True, exist_ok=True)
    files = {k: str(path / v) for k, v in FILES.items()}
    png = None
    if e.capture is not None and e.comparison.band is not None:
        from mixprec.report.explain_plots import explanation_figure

        span = e.comparison.band.rule.span
        png = figure_to_png(explanation_figure(e, lambda x: ema(x, span), f"EMA span {span}"))
    else:
        files.pop("png")
    e.files = dict(files)
    page = HtmlReport(f"mixprec compare --explain: {e.recipe} on {e.task}")
    page.paragraph(f"{e.status}: {e.summary}", css_class="bad" if e.alarming else "ok")
    if e.fix is not None:
        page.heading("The fix (verified)")
        page.pre(e.fix.code)
        page.paragraph(f"{e.fix.verdict.status} over all {e.steps} steps ({e.fix.verdict.message}); step time "
                       f"x{e.fix.step_time_vs_recipe:.2f} the failing recipe's, x{e.fix.step_time_vs_fp32:.2f} fp32's "
                       "(indicative: runs one after another on this machine).")
    if png is not None:
        page.image(png, caption="Top: each module's error against fp32 along the forward, with the format's unit "
                   "roundoff; culprits in red. Bottom: the failing recipe and the verified fix over fp32's noise band.")
    if e.alternatives:
        page.heading("Other changes that tracked on the short horizon (not verified on all steps)")
        page.pre("\n".join(o.candidate.code(e.base) for o in e.alternatives))
    page.heading("Hypotheses")
    for f in e.findings:
        page.paragraph(f"[{f.status}] {f.title}: {f.conclusion}",
                       css_class={"HOLDS": "bad", "REJECTED": "ok"}.get(f.status))
        if f.evidence:
            page.pre("\n".join(f.evidence))
        if f.outcomes:
            page.table(["change", "verdict", "steps run", "note"],
                       [[o.candidate.change, o.verdict.status, "-" if o.run is None else f"{o.run.steps}/{o.horizon}",
                         o.verdict.message if o.run is None else (o.run.stopped or "")] for o in f.outcomes],
                       classes=["ok" if o.tracks else "bad" for o in f.outcomes])
    if e.capture is not None:
        c = e.capture
        page.heading("Modules against fp32")
        page.paragraph(f"Measured at steps {', '.join(map(str, c.steps))} of the run that failed, fp32 on the same "
                       f"weights and batch; u = {c.unit_roundoff:.3g} ({c.compute}). Output {c.output_dtype}, loss "
                       f"{c.loss_dtype}." + (" " + " ".join(c.notes) if c.notes else ""))
        page.table(["module", "type", "out", "output err", "input err", "added", "grad err", "grad added", "flushed",
                    "kept", "note"],
                   [[m.label, m.type, m.out_dtype, _f(m.fwd), _f(m.fwd_in), _f(m.added), _f(m.grad), _f(m.grad_added),
                     _pct(m.flushed), _pct(m.kept), ("island" if m.island else "") + (m.unmeasured or "")]
                    for m in c.modules],
                   classes=["bad" if m.name in e.culprits else None for m in c.modules])
    page.heading("Cost")
    page.paragraph(f"{e.runs} training runs ({e.steps_trained} steps), {e.search_runs} of them for the island search "
                   f"over {e.module_count} modules; {e.wall_s:.1f} s with --jobs {e.jobs}.")
    contents: dict[str, bytes | str] = {FILES["html"]: page.render(), FILES["json"]: e.to_json()}
    if png is not None:
        contents[FILES["png"]] = png
    publish_files(path, contents, last=FILES["json"])
    return files


def _f(x: Any) -> str:
    if x is None:
        return "-"
    return "inf" if x == float("inf") else f"{x:.2g}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.0%}"
