"""Rich tables (and Markdown rows) from the JSON the runners return; no torch needed."""

from __future__ import annotations

from typing import Any

from rich.table import Table


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
    return f"{r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}]"


def bench_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the recipe table: one row per variant."""
    headers = ["variant", "step ms (median)", "IQR %", "speedup vs fp32 [IQR]", "tokens/s", "FLOP/s",
               "% of peak", "ideal ms", "saved act MiB", "act MiB", "step peak MiB", "syncs/step"]
    rows = []
    for r in doc["results"]:
        if r["status"] != "ok":
            rows.append([r["label"], f"{r['status']}: {_first_line(r['error'])}"] + [""] * (len(headers) - 2))
            continue
        s, mem = r["step_s"], r.get("memory") or {}
        iqr = 100 * (s["q75"] - s["q25"]) / s["median"]
        frac = r.get("peak_fraction")
        rows.append([
            r["label"], _ms(s["median"]), f"{iqr:.1f}", _ratio(r.get("speedup_vs_fp32")),
            _si(r["tokens_per_s"]), _si(r["achieved_flops_per_s"]),
            "n/a" if frac is None else f"{100 * frac:.1f} ({r['peak_key']})", _ms(r.get("ideal_s")),
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


def overhead_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["recipe", "optimizer", "mixprec ms", "hand ms", "iteration ratio [IQR] (95% CI)", "step ratio [IQR]",
               "extra us/step", "extra ops/step", "vs plain", "param diff"]
    rows = []
    for run in doc["runs"]:
        if run["status"] != "ok":
            rows.append([run["recipe"], run["optimizer"], f"error: {_first_line(run['error'])}"] + [""] * (len(headers) - 3))
            continue
        ri = run["ratio_iteration"]
        rows.append([
            run["recipe"], run["optimizer"],
            _ms(run["arms"]["mixprec"]["iteration_s"]["median"]), _ms(run["arms"]["hand"]["iteration_s"]["median"]),
            f"{_ratio(ri)} ({ri['ci95_low']:.3f}-{ri['ci95_high']:.3f})", _ratio(run["ratio_step"]),
            f"{run['extra_us_per_step']:.0f}",
            " ".join(f"{k.removeprefix('aten.')}{v:+d}" for k, v in run["extra_ops_per_step"].items()) or "0",
            _ratio(run.get("ratio_iteration_vs_plain")),
            f"{run['max_param_diff_vs_hand']:.1e}",
        ])
    return headers, rows


def rich_table(title: str, headers: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for h in headers:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


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
