"""Rich tables (and Markdown rows) from the JSON the runners return; no torch needed."""

from __future__ import annotations

from typing import Any


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def _first_line(text: str, limit: int = 200) -> str:
    """Errors from torch.compile run to pages; a table cell gets the first line (the JSON has all)."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.4g}"


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _ratio(r: dict[str, float] | None) -> str:
    if not r:
        return "n/a"
    return f"{r['median']:.3f} [{r['q25']:.3f}-{r['q75']:.3f}]"


#: What the recipe table's short headers mean (printed under it).
BENCH_LEGEND = (
    "speedup = fp32's step time / this variant's (> 1: faster than fp32), median [IQR] over "
    "interleaved rounds; % peak: achieved FLOP/s over the matmul peak of the compute dtype measured "
    "in this run; ideal ms: the step's FLOPs at that peak; act saved: bytes autograd keeps for "
    "backward; act: storages the forward makes and holds; peak: the step's peak memory (weights, "
    "masters, optimizer state and the most one step holds above them); syncs: host syncs per step (CUDA)"
)


def bench_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the recipe table: one row per variant (short headers: ``BENCH_LEGEND``)."""
    headers = ["variant", "step ms", "IQR %", "speedup [IQR]", "tokens/s", "FLOP/s", "% peak", "ideal ms",
               "act saved MiB", "act MiB", "peak MiB", "syncs"]
    rows = []
    for r in doc["results"]:
        if r["status"] != "ok":
            rows.append([r["label"], r["status"], _first_line(r["error"], 40)] + [""] * (len(headers) - 3))
            continue
        s, mem = r["step_s"], r.get("memory") or {}
        iqr = 100 * (s["q75"] - s["q25"]) / s["median"]
        frac = r.get("peak_fraction")
        rows.append([
            r["label"], _ms(s["median"]), f"{iqr:.1f}", _ratio(r.get("speedup_vs_fp32")),
            _si(r["tokens_per_s"]), _si(r["achieved_flops_per_s"]),
            "n/a" if frac is None else f"{100 * frac:.1f} {r['peak_key']}", _ms(r.get("ideal_s")),
            _mib(mem.get("saved_bytes")), _mib(mem.get("forward_delta")), _mib(mem.get("peak_step")),
            "n/a" if r.get("syncs_per_step") is None else f"{r['syncs_per_step']:g}",
        ])
    return headers, rows


def peak_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["dtype", "n", "FLOP/s", "A@B ms", "A@B.T ms"]
    rows = []
    for key, p in doc.get("peaks", {}).items():
        if "error" in p:
            rows.append([key, "", f"error: {p['error']}", "", ""])
            continue
        rows.append([key, str(p["n"]), _si(p["flops_per_s"]), _ms(p["layouts"].get("nn")), _ms(p["layouts"].get("nt"))])
    return headers, rows


OVERHEAD_LEGEND = (
    "ratio = mixprec / hand: mixprec's time over the hand-written loop's per interleaved round, median [IQR] "
    "(< 1: mixprec is faster); iter: the whole iteration (forward, backward, step), step: the step "
    "alone; extra: what mixprec's step adds (microseconds, ATen ops) per step; vs plain: mixprec / "
    "a plain loop without a scaler; param diff: max |mixprec - hand| of the parameters after the run"
)


def overhead_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["recipe", "optimizer", "mixprec ms", "hand ms", "iter ratio [IQR]", "95% CI", "step ratio [IQR]",
               "extra us", "extra ops", "vs plain", "param diff"]
    rows = []
    for run in doc["runs"]:
        if run["status"] != "ok":
            rows.append([run["recipe"], run["optimizer"], "error", _first_line(run["error"], 40)] + [""] * (len(headers) - 4))
            continue
        ri = run["ratio_iteration"]
        rows.append([
            run["recipe"], run["optimizer"],
            _ms(run["arms"]["mixprec"]["iteration_s"]["median"]), _ms(run["arms"]["hand"]["iteration_s"]["median"]),
            _ratio(ri), f"{ri['ci95_low']:.3f}-{ri['ci95_high']:.3f}", _ratio(run["ratio_step"]),
            f"{run['extra_us_per_step']:.0f}",
            " ".join(f"{k.removeprefix('aten.')}{v:+d}" for k, v in run["extra_ops_per_step"].items()) or "0",
            _ratio(run.get("ratio_iteration_vs_plain")),
            f"{run['max_param_diff_vs_hand']:.1e}",
        ])
    return headers, rows


def print_table(console: Any, title: str, headers: list[str], rows: list[list[str]], keep: int = 1,
                legend: str | None = None) -> None:
    """Print the rows as tables that fit the console's width (columns folded into several tables
    rather than cells wrapped), then the legend."""
    from mixprec.report.terminal import fitted_tables

    for table in fitted_tables(headers, rows, console.width, title=title, keep=keep):
        console.print(table)
    if legend:
        console.print(legend, style="dim", highlight=False)


def errors_of(doc: dict[str, Any]) -> list[str]:
    """'label: first line of the error' for every variant or run that failed (the table cuts them)."""
    return [f"{r.get('label', r.get('recipe'))}: {_first_line(r['error'])}"
            for r in doc.get("results", doc.get("runs", [])) if r.get("status") != "ok" and r.get("error")]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """GitHub Markdown, for pasting into BENCHMARKS.md."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def roofline_lines(doc: dict[str, Any]) -> list[str]:
    """The FLOPs of the block and the ideal step time at each measured peak."""
    f, shape = doc["flops"], doc["shape"]
    lines = [
        f"shape {shape['name']}: d={shape['d_model']} heads={shape['n_head']} B={shape['batch']} T={shape['seq']} "
        f"({shape['tokens']} tokens)",
        f"FLOPs per step {f['step']:.4g} (forward {f['forward']:.4g}); {f['formula']}",
    ]
    for key, p in doc.get("peaks", {}).items():
        if "flops_per_s" in p:
            lines.append(f"  at the measured {key} peak {_si(p['flops_per_s'], 'FLOP/s')}: ideal step "
                         f"{_ms(f['step'] / p['flops_per_s'])} ms")
    return lines


def compact_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A narrow recipe table for the end of a log: time, speedup, % of peak, memory, syncs."""
    headers = ["variant", "step ms", "x fp32", "% peak", "act MiB", "peak MiB", "syncs"]
    rows = []
    for r in doc["results"]:
        if r["status"] != "ok":
            rows.append([r["label"], r["status"], _first_line(r["error"], 60), "", "", "", ""])
            continue
        mem = r.get("memory") or {}
        act = mem.get("forward_delta") if mem.get("forward_delta") is not None else mem.get("saved_bytes")
        sp, frac = r.get("speedup_vs_fp32"), r.get("peak_fraction")
        rows.append([
            r["label"], _ms(r["step_s"]["median"]), "n/a" if not sp else f"{sp['median']:.2f}",
            "n/a" if frac is None else f"{100 * frac:.1f} {r['peak_key']}", _mib(act), _mib(mem.get("peak_step")),
            "n/a" if r.get("syncs_per_step") is None else f"{r['syncs_per_step']:g}",
        ])
    return headers, rows
