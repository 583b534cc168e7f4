"""The figure of ``mixprec compare``: loss curves over the fp32 noise band, and the loss scale.

Top panel: every recipe's smoothed loss (raw loss faint behind it) over the shaded fp32 band,
with the step where a recipe left the band or went non-finite marked. Bottom panel: the loss
scale of recipes that use a scaler, on a log axis, with skipped steps marked.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np

from mixprec.report.figures import new_figure

WIDTH_IN, HEIGHT_IN, DPI = 10.0, 7.5, 100  # the PNG is 1000 x 750 pixels
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
# recipes that track lie on top of each other: distinct dashes keep each one visible
_DASHES = ["-", "--", "-.", (0, (1, 1)), (0, (5, 1, 1, 1, 1, 1))]


def comparison_figure(result: Any, smooth: Callable[[Any], np.ndarray], smooth_label: str):
    """A two-panel figure for a ``ComparisonResult`` (duck-typed: runs, verdicts, band, reference),
    the curves drawn through ``smooth`` (the verdict's smoothing, handed in by the caller and named
    on the axis by ``smooth_label``)."""
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_scale) = new_figure(
        2, 1, width=WIDTH_IN, height=HEIGHT_IN, dpi=DPI, sharex=True, gridspec_kw={"height_ratios": [2.2, 1]}
    )
    band = result.band
    ref = result.reference
    x_ref = np.arange(1, len(ref.loss) + 1)
    finite_values: list[np.ndarray] = []

    if band is not None:
        xb = np.arange(1, len(band.center) + 1)
        lower = band.lower
        fp32_losses = np.concatenate([r.loss for r in result.runs if r.role in ("reference", "noise")])
        fp32_losses = fp32_losses[np.isfinite(fp32_losses)]
        if len(fp32_losses) and fp32_losses.min() >= 0:  # a loss that cannot go below 0 (cross-entropy, MSE)
            lower = np.maximum(lower, 0.0)  # draws no band there either
        ax_loss.fill_between(xb, lower, band.upper, color="0.6", alpha=0.35, lw=0, label="fp32 noise band")
        finite_values += [lower, band.upper]
    for run in result.noise:
        if np.isfinite(run.loss).all():
            ax_loss.plot(np.arange(1, len(run.loss) + 1), smooth(run.loss), color="0.45", lw=0.8, ls="--")
    ax_loss.plot([], [], color="0.45", lw=0.8, ls="--", label=f"fp32, other seeds ({len(result.noise)})")
    if np.isfinite(ref.loss).all():
        ax_loss.plot(x_ref, ref.loss, color="black", lw=0.6, alpha=0.15)
        # drawn wide and first: a recipe that tracks closely shows as a coloured line on a black edge
        ax_loss.plot(x_ref, smooth(ref.loss), color="black", lw=3.2, label="fp32 (seed 0, reference)")

    scaled_any = False
    annotated = 0
    for i, run in enumerate(r for r in result.runs if r.role == "candidate"):
        color = _COLORS[i % len(_COLORS)]
        verdict = result.verdicts.get(run.recipe)
        status = verdict.status if verdict is not None else "?"
        x = np.arange(1, len(run.loss) + 1)
        finite = np.isfinite(run.loss)
        if finite.any():
            ax_loss.plot(x[finite], run.loss[finite], color=color, lw=0.6, alpha=0.2)
            upto = int(np.argmin(finite)) if not finite.all() else len(run.loss)
            if upto > 0:
                smoothed = smooth(run.loss[:upto])
                ax_loss.plot(x[:upto], smoothed, color=color, lw=1.6, ls=_DASHES[i % len(_DASHES)],
                             label=f"{run.label}: {status}")
                finite_values.append(smoothed)
        else:
            ax_loss.plot([], [], color=color, lw=1.6, label=f"{run.label}: {status}")
        if verdict is not None and verdict.first_step is not None:
            ax_loss.axvline(verdict.first_step, color=color, lw=1.0, ls=":")
            ax_loss.annotate(  # stacked downwards: recipes failing at the same step must not overprint
                f"{run.label}\n{status} @ {verdict.first_step}", xy=(verdict.first_step, 1.0),
                xycoords=("data", "axes fraction"), xytext=(3, -4 - 24 * annotated), textcoords="offset points",
                va="top", fontsize=8, color=color,
            )
            annotated += 1
        if run.loss_scaling != "none" and len(run.scale):
            scaled_any = True
            skipped = np.flatnonzero(run.skipped)
            ax_scale.step(x, run.scale, where="post", color=color, lw=1.3,
                          label=f"{run.label} loss scale ({len(skipped)} skipped steps)")
            if len(skipped):
                ax_scale.plot(x[skipped], run.scale[skipped], "v", color=color, ms=5, mec="black", mew=0.5)

    _limit_loss_axis(ax_loss, finite_values)
    ax_loss.set_ylabel(f"loss ({smooth_label}; raw faint)")
    title = f"{result.task} on {result.device}: {result.description or ''}".rstrip(": ")
    ax_loss.set_title(textwrap.fill(title, 120), fontsize=10)
    ax_loss.legend(loc="best", fontsize=8, framealpha=0.9)
    ax_loss.grid(alpha=0.3)

    if scaled_any:
        ax_scale.set_yscale("log", base=2)
        ax_scale.legend(loc="best", fontsize=8, framealpha=0.9)
    else:
        not_run = [name for name in result.verdicts if all(r.recipe != name for r in result.runs)]
        text = (f"not run: {', '.join(not_run)} (fp32 itself failed, see the report)" if not_run
                else "no recipe here uses a loss scaler (fp32 and bf16 need none)")
        ax_scale.text(0.5, 0.5, text, ha="center", va="center", transform=ax_scale.transAxes, color="0.4")
        ax_scale.set_yticks([])
    ax_scale.set_ylabel("loss scale (log2)")
    ax_scale.set_xlabel("optimizer step")
    ax_scale.grid(alpha=0.3)
    ax_scale.set_xlim(1, max(2, result.steps))
    ax_scale.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _limit_loss_axis(ax, values: list[np.ndarray]) -> None:
    """Fit the y axis to the band and the smoothed curves (raw per-batch spikes may be clipped),
    so that one exploding curve or noisy batch does not flatten the rest."""
    flat = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.zeros(0)
    if not len(flat):
        return
    lo, hi = float(np.min(flat)), float(np.max(flat))
    pad = 0.05 * max(hi - lo, 1e-12 + 1e-6 * abs(hi))
    ax.set_ylim(lo - pad, hi + pad)
