"""The figure of ``mixprec compare --explain``: where the error enters, and the fix beside the failure.

Top panel: the modules along the forward (in the order they first ran), the relative error
against fp32 of each module's output (what it received plus what it added), of what it adds by
itself (run alone on fp32's input) and of the gradient at its output, on a log axis, with the
compute format's unit roundoff u as a line. Non-finite errors sit on the top edge. Culprits (the
island set found, or the entry points) are marked. Bottom panel: the smoothed loss of the failing
recipe and of the verified fix over the shaded fp32 noise band (and the loss scale, when the
recipe has one, on a second axis).

Duck-typed: it is handed an ``Explanation`` (and the verdict's smoothing) and draws numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mixprec.report.figures import new_figure

WIDTH_IN, DPI = 10.0, 80  # 800 pixels wide: small enough to commit


def _finite_or_top(values: list[float | None], top: float) -> tuple[np.ndarray, np.ndarray]:
    arr = np.array([np.nan if v is None or v != v else v for v in values], dtype=np.float64)
    inf = np.isinf(arr)
    arr[inf] = top
    arr[arr <= 0] = np.nan  # exactly fp32's: no point on a log axis
    return arr, inf


def explanation_figure(e: Any, smooth: Callable[[np.ndarray], np.ndarray], smooth_label: str):
    """Two panels (module doc) for an ``Explanation`` that went as far as measuring modules."""
    cap = e.capture
    fig, (ax_m, ax_l) = new_figure(2, 1, width=WIDTH_IN, height=8.0, dpi=DPI, gridspec_kw={"height_ratios": [1.3, 1]})
    mods = [m for m in cap.modules if m.name != ""] or list(cap.modules)
    x = np.arange(len(mods))
    finite = [v for m in mods for v in (m.fwd, m.added, m.grad, m.grad_added)
              if v is not None and v == v and math.isfinite(v) and v > 0]
    top = max([cap.unit_roundoff * 100, *finite]) * 10
    for values, label, style in (
        ([m.fwd for m in mods], "output vs fp32 (received + added)", dict(color="#1f77b4", marker="o", lw=1.2)),
        ([m.added for m in mods], "added by the module alone (fp32 input)", dict(color="#d62728", marker="s", lw=0, ms=6)),
        ([m.grad for m in mods], "gradient at its output vs fp32", dict(color="#2ca02c", marker="^", lw=0.8, ls="--")),
        ([m.grad_added for m in mods], "gradient added by its backward alone", dict(color="#9467bd", marker="v", lw=0,
                                                                                    ms=5, mfc="none")),
    ):
        y, inf = _finite_or_top(values, top)
        ax_m.plot(x, y, label=label, **style)
        if inf.any():
            ax_m.plot(x[inf], y[inf], ls="none", marker="*", ms=13, color=style["color"], mec="black")
    u = cap.unit_roundoff
    ax_m.axhline(u, color="black", lw=1.0, ls=":", label=f"unit roundoff u of {cap.compute} ({u:.2g})")
    ax_m.set_yscale("log")
    ax_m.set_ylim(top=top * 3)
    ax_m.axhline(top, color="0.6", lw=0.6, ls="-")
    ax_m.annotate("non-finite", xy=(0.0, top), xycoords=("axes fraction", "data"), xytext=(-4, 0),
                  textcoords="offset points", ha="right", va="center", fontsize=7, color="0.3")
    culprits = set(e.culprits)
    entry = {m.name for m in cap.entry_points()} - culprits
    ax_m.set_xticks(x)
    ax_m.set_xticklabels([m.label for m in mods], rotation=70, ha="right", fontsize=7 if len(mods) > 25 else 8)
    for i, m in enumerate(mods):
        if m.name in culprits:
            ax_m.get_xticklabels()[i].set_color("#d62728")
            ax_m.get_xticklabels()[i].set_fontweight("bold")
            ax_m.axvspan(i - 0.4, i + 0.4, color="#d62728", alpha=0.12, lw=0)
        elif m.name in entry:
            ax_m.get_xticklabels()[i].set_color("#ff7f0e")
        elif m.island:
            ax_m.get_xticklabels()[i].set_color("0.5")
    ax_m.set_ylabel("relative error vs fp32")
    steps = ", ".join(map(str, cap.steps))
    ax_m.set_title(f"{e.recipe} on {e.task}: each module against fp32 (worst of steps {steps})\n"
                   "red: the island set found; orange: other entry points; grey: fp32 islands already", fontsize=9)
    ax_m.legend(loc="upper left", fontsize=7, framealpha=0.9)
    ax_m.grid(alpha=0.3, which="both", axis="y")

    comparison = e.comparison
    band = comparison.band
    xb = np.arange(1, len(band.center) + 1)
    ax_l.fill_between(xb, np.maximum(band.lower, 0) if band.center.min() >= 0 else band.lower, band.upper,
                      color="0.6", alpha=0.35, lw=0, label="fp32 noise band")
    ax_l.plot(xb, band.center, color="black", lw=2.4, label="fp32 (reference)")
    failing = comparison.run_for(e.recipe)
    _curve(ax_l, failing.loss, smooth, "#d62728", f"{e.recipe}: {e.verdict.status}")
    if e.fix is not None:
        _curve(ax_l, e.fix.run.loss, smooth, "#2ca02c", f"fix: {e.fix.change}: {e.fix.verdict.status}")
    if e.horizon:
        ax_l.axvline(e.horizon, color="0.4", lw=0.8, ls=":")
        ax_l.annotate(f"short horizon ({e.horizon} steps)", xy=(e.horizon, 1.0), xycoords=("data", "axes fraction"),
                      xytext=(3, -12), textcoords="offset points", fontsize=7, color="0.3")
    lo, hi = float(np.min(band.lower)), float(np.max(band.upper))
    for run in [failing] + ([e.fix.run] if e.fix is not None else []):
        fin = run.loss[np.isfinite(run.loss)]
        if len(fin):
            s = smooth(fin)
            lo, hi = min(lo, float(s.min())), max(hi, float(s.max()))
    pad = 0.05 * max(hi - lo, 1e-9)
    ax_l.set_ylim(lo - pad, hi + pad)
    ax_l.set_xlabel("optimizer step")
    ax_l.set_ylabel(f"loss ({smooth_label})")
    ax_l.legend(loc="best", fontsize=8, framealpha=0.9)
    ax_l.grid(alpha=0.3)
    if failing.loss_scaling != "none" and len(failing.scale):
        ax_s = ax_l.twinx()
        ax_s.step(np.arange(1, len(failing.scale) + 1), failing.scale, where="post", color="#d62728", lw=0.8, alpha=0.5)
        if e.fix is not None and e.fix.run.loss_scaling != "none":
            ax_s.step(np.arange(1, len(e.fix.run.scale) + 1), e.fix.run.scale, where="post", color="#2ca02c", lw=0.8,
                      alpha=0.5)
        ax_s.set_yscale("log", base=2)
        ax_s.set_ylabel("loss scale (thin lines)", fontsize=8)
    fig.tight_layout()
    return fig


def _curve(ax: Any, loss: np.ndarray, smooth: Callable[[np.ndarray], np.ndarray], color: str, label: str) -> None:
    x = np.arange(1, len(loss) + 1)
    ok = np.isfinite(loss)
    upto = int(np.argmin(ok)) if not ok.all() else len(loss)
    if upto:
        ax.plot(x[:upto], loss[:upto], color=color, lw=0.5, alpha=0.2)
        ax.plot(x[:upto], smooth(loss[:upto]), color=color, lw=1.8, label=label)
    else:
        ax.plot([], [], color=color, lw=1.8, label=label)
    if upto < len(loss):
        ax.axvline(upto + 1, color=color, lw=1.0, ls="--")
        ax.annotate(f"non-finite from step {upto + 1}", xy=(upto + 1, 0.5), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", fontsize=7, color=color, rotation=90)
