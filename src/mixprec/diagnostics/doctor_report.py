"""``DoctorReport`` (what ``doctor`` found) and its rendering: a rich table for the terminal, an HTML
page with the figures, JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from mixprec.diagnostics.checks import Evidence
from mixprec.diagnostics.findings import STATUSES, Finding
from mixprec.diagnostics.probes._common import pow2_label, rounding_thresholds
from mixprec.diagnostics.probes.gradients import HIST_LO
from mixprec.formats import get_format

@dataclasses.dataclass
class DoctorReport:
    """The findings, in checklist order, and the evidence behind them (``evidence.run`` etc.)."""

    task: str
    description: str
    recipe: str
    device: str
    findings: list[Finding]
    evidence: Evidence
    seconds: float

    @property
    def alarming(self) -> bool:
        return any(f.alarming for f in self.findings)

    @property
    def exit_code(self) -> int:
        """1 when a finding is an alarm, else 0 (what ``mixprec doctor`` exits with)."""
        return 1 if self.alarming else 0

    def get(self, check: str) -> Finding:
        for f in self.findings:
            if f.check == check:
                return f
        raise KeyError(f"no finding {check!r}; checks: {[f.check for f in self.findings]}")

    def worst(self) -> list[Finding]:
        """Findings ordered most severe first (stable within a status)."""
        return sorted(self.findings, key=lambda f: STATUSES.index(f.status))

    def to_dict(self) -> dict[str, Any]:
        ev = self.evidence
        return {
            "task": self.task, "description": self.description, "recipe": self.recipe, "device": self.device,
            "alarming": self.alarming, "seconds": round(self.seconds, 2),
            "findings": [f.to_dict() for f in self.findings],
            "runs": {r.recipe: r.to_dict() for r in (ev.run, ev.fp32, ev.bf16) if r is not None},
            "probes": {
                "grad_underflow": None if ev.grads is None else ev.grads.to_dict([1.0, ev.run.train_scale] + (
                    [ev.grads.recommended_scale] if ev.grads.recommended_scale else [])),
                "update_vanishing": None if ev.updates is None else ev.updates.to_dict(),
                "activation_range": None if ev.activations is None else ev.activations.to_dict(),
            },
            "errors": ev.errors,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict`` as strict JSON: a NaN or infinite number (a loss, a gradient norm) is ``null``, as in
        ``compare.json`` (``NaN`` is not JSON: jq-less parsers, browsers and ``JSON.parse`` refuse it)."""
        return json.dumps(_strict(self.to_dict()), indent=indent, default=str, allow_nan=False)

    def render_text(self, width: int = 100) -> str:
        return render_text(self, width)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``doctor.html``, ``doctor.json`` and the PNG figures into ``out_dir``."""
        return write_report(self, Path(out_dir))


def _strict(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (and tuples as lists), for strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


_STYLE = {"alarm": "bold red", "warn": "bold yellow", "info": "cyan", "ok": "green", "skipped": "dim"}
_CSS = {"alarm": "bad", "warn": "warn", "info": None, "ok": "ok", "skipped": None}


def renderables(report: "DoctorReport") -> list[Any]:
    """rich objects: a header, the checklist table, then the details of what is not ok."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = [Text.assemble(
        ("mixprec doctor", "bold"), f"  task {report.task}  recipe {report.recipe}  device {report.device}  "
        f"({report.seconds:.1f}s)")]
    table = Table(show_lines=False, expand=True)
    table.add_column("", width=7, no_wrap=True)
    table.add_column("check", ratio=2)
    table.add_column("finding", ratio=5)
    for f in report.findings:
        table.add_row(Text(f.status.upper(), style=_STYLE[f.status]), f.title, f.summary)
    out.append(table)
    for f in report.worst():
        if f.status in ("ok", "skipped"):
            continue
        body = Text()
        body.append(f.summary + "\n")
        for line in f.evidence:
            body.append(f"  {line}\n", style="dim")
        if f.fix:
            body.append("fix: ", style="bold")
            body.append(f.fix)
        out.append(Panel(body, title=f"{f.status.upper()}: {f.title}", border_style=_STYLE[f.status], title_align="left"))
    verdict = ("[bold red]alarming findings: see above[/]" if report.alarming
               else "[bold green]nothing alarming[/] (" + ", ".join(sorted({f.status for f in report.findings})) + ")")
    out.append(verdict)
    return out


def render_text(report: "DoctorReport", width: int = 100) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, color_system=None)
    for r in renderables(report):
        console.print(r)
    return console.export_text()


def figures(report: "DoctorReport") -> dict[str, tuple[bytes, str]]:
    """name -> (PNG bytes, caption) for the figures the evidence supports."""
    from mixprec.report.doctor_plots import bars_png, gradient_histogram_png, scale_history_png

    ev = report.evidence
    out: dict[str, tuple[bytes, str]] = {}
    if ev.grads is not None and ev.grads.overall.nonzero:
        f16 = get_format("f16")
        z0, _, _ = rounding_thresholds(f16)
        zones = (math.log2(z0), math.log2(f16.smallest_subnormal), math.log2(f16.tiny), math.log2(f16.max))
        ranges = {n: get_format(n).log2_range for n in ev.grads.formats}
        scale = ev.run.train_scale  # (after the scaler's warm-up: what the gradient-underflow check judges)
        k = int(math.log2(scale)) if scale > 0 else 0
        out["grad_histogram.png"] = (
            gradient_histogram_png(ev.grads.overall.hist.tolist(), HIST_LO, zones, ranges, shift_bits=k,
                                   shift_label=pow2_label(scale),
                                   title=f"{report.task}: all gradients (parameters and module outputs), one fp32 backward"),
            f"log2 |gradient| of one fp32 backward against fp16's zones; the outline is the histogram times the "
            f"loss scale the run trains at, {pow2_label(scale)}; bars below: each format's range",
        )
        fmt = "f16"
        rows = sorted(((s, s.landing(fmt, 1.0), s.landing(fmt, scale)) for s in ev.grads.by_module() if s.nonzero),
                      key=lambda t: -t[1].zero)[:15]
        if rows:
            series = {"scale 1": [100 * r[1].zero for r in rows], f"scale {pow2_label(scale)}": [100 * r[2].zero for r in rows]}
            if ev.grads.recommended_scale:
                series[f"scale {pow2_label(ev.grads.recommended_scale)} (recommended)"] = [
                    100 * r[0].landing(fmt, ev.grads.recommended_scale).zero for r in rows]
            out["grad_underflow.png"] = (
                bars_png([r[0].name for r in rows], series, title="Parameter gradients flushed to zero in fp16, per module",
                         xlabel="% of nonzero values that become 0",
                         empty_text="nothing underflows: no parameter gradient becomes 0 in fp16 at these scales"),
                "share of each module's parameter gradient values that would become 0 in fp16 at each loss scale",
            )
    if ev.activations is not None and ev.activations.entries:
        top = sorted(ev.activations.entries, key=lambda e: e.headroom_bits)[:15]
        limit = get_format(ev.activations.fmt).max
        out["activation_range.png"] = (
            bars_png([e.label for e in top], {"largest |x| (fp32 run)": [max(e.absmax, 1e-30) for e in top]},
                     title=f"Largest activations computed in 16 bits under {report.recipe}", xlabel="|x|", log=True,
                     limit=limit, limit_label=f"{ev.activations.fmt} max {limit:g}"),
            "the 15 ops / module outputs closest to the format's maximum",
        )
    if ev.updates is not None and ev.updates.params:
        worst = ev.updates.worst("bf16", 15)
        out["update_vanishing.png"] = (
            bars_png([p.name for p in worst], {f: [100 * p.vanished[f] for p in worst] for f in ev.updates.formats},
                     title="Updates lost if the weights were stored in 16 bits (one optimizer step)",
                     xlabel="% of updated elements where w + dw == w"),
            "parameters that need fp32 master weights: their updates vanish in 16-bit storage",
        )
    hist = ev.run.history
    if hist and hist.get("scale"):
        out["loss_scale.png"] = (scale_history_png(hist["scale"], hist["skipped"]),
                                 f"loss scale per step under {report.recipe} (red: skipped steps)")
    return out


FILES = ("doctor.html", "doctor.json", "grad_histogram.png", "grad_underflow.png", "activation_range.png",
         "update_vanishing.png", "loss_scale.png")


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse a directory that cannot be written, or whose files of our names an earlier doctor did not write."""
    from mixprec.report.outdir import check_writable_dir

    path = check_writable_dir(out_dir)
    clashes = [name for name in FILES if (path / name).exists()]
    if clashes and not _written_by_doctor(path / "doctor.json"):
        raise FileExistsError(
            f"{str(path)!r} already holds {', '.join(clashes)}, not written by 'mixprec doctor' (no doctor.json "
            "of ours beside them); choose another --out or move those files"
        )
    return path


def _written_by_doctor(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"findings", "probes", "runs"} <= data.keys()


def write_report(report: "DoctorReport", out_dir: Path) -> dict[str, Path]:
    """``doctor.html``, ``doctor.json`` and the PNGs in ``out_dir``, published as one set (see
    ``mixprec.report.publish``); returns name -> path."""
    from mixprec.report import HtmlReport
    from mixprec.report.publish import publish_files

    check_out_dir(out_dir)
    figs = figures(report)
    page = HtmlReport(f"mixprec doctor: {report.task} under {report.recipe}")
    page.paragraph(f"{report.description} — device {report.device}, {report.seconds:.1f}s. "
                   + ("Alarming findings." if report.alarming else "Nothing alarming."),
                   "bad" if report.alarming else "ok")
    page.table(["status", "check", "finding"], [[f.status.upper(), f.title, f.summary] for f in report.findings],
               [_CSS[f.status] for f in report.findings])
    for f in report.worst():
        if f.status in ("ok", "skipped"):
            continue
        page.heading(f"{f.status.upper()}: {f.title}")
        page.paragraph(f.summary, _CSS[f.status])
        if f.evidence:
            page.pre("\n".join(f.evidence))
        if f.fix:
            page.paragraph("Fix: " + f.fix)
    page.heading("Figures")
    for name, (png, caption) in figs.items():
        page.image(png, caption)
    page.heading("All findings")
    for f in report.findings:
        page.heading(f.title, 3)
        page.paragraph(f"{f.status.upper()}: {f.summary}", _CSS[f.status])
        if f.evidence:
            page.pre("\n".join(f.evidence))
    contents = {name: png for name, (png, _) in figs.items()}
    contents["doctor.html"] = page.render().encode("utf-8")
    contents["doctor.json"] = report.to_json().encode("utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    # an earlier doctor's figure this run has none of would sit beside the new report as if it were its
    # own (check_out_dir made sure that files of our names there are an earlier doctor's): it leaves too
    stale = [n for n in FILES if n not in contents and (out_dir / n).is_file()]
    publish_files(out_dir, contents, "doctor.json", tuple(stale))
    return {name: out_dir / name for name in contents}


