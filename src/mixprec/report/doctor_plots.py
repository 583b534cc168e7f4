"""Figures for ``mixprec doctor``: plain numbers in, PNG bytes out (no torch here).

- ``gradient_histogram_png``: log2 |gradient| against fp16's zero / subnormal / normal / overflow
  zones, the histogram shifted by the loss scale, and the ranges of bf16 and fp8 below (the
  figure of the mixed-precision paper, for the user's model).
- ``bars_png``: horizontal bars for per-module / per-parameter fractions or magnitudes.
- ``scale_history_png``: the loss scale per step with the skipped steps marked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mixprec.report.figures import figure_to_png, new_figure

_ZONES = {"zero": "#f4c7c3", "subnormal": "#fce8b2", "normal": "#d9ead3", "overflow": "#f4c7c3"}


def gradient_histogram_png(
    counts: Sequence[int],
    lo_exponent: int,
    f16_zones: tuple[float, float, float, float],
    ranges: Mapping[str, tuple[float, float]],
    *,
    shift_bits: int = 0,
    shift_label: str = "",
    title: str = "Gradient magnitudes",
) -> bytes:
    """The histogram of floor(log2 |g|) (``counts[i]`` values with exponent ``lo_exponent + i``).

    Args:
        f16_zones: log2 of (half the smallest subnormal, smallest subnormal, smallest normal, max):
            below the first a value becomes 0, then subnormal, then normal, past the last: inf.
        ranges: format name -> (log2 smallest subnormal, log2 max), drawn as bars under the histogram.
        shift_bits: draw the histogram again shifted by this many bits (the loss scale).
    """
    total = sum(counts) or 1
    used = [i for i, c in enumerate(counts) if c]
    z0, sub, tiny, mx = f16_zones
    lo = min([lo_exponent + used[0] if used else -30, z0]) - 3
    hi = max([lo_exponent + used[-1] + 1 + max(shift_bits, 0) if used else 16, mx]) + 3
    fig, (ax, ax2) = new_figure(2, 1, width=9.0, height=5.2, gridspec_kw={"height_ratios": [4, 1.3]}, sharex=True)
    for a, b, zone in ((lo, z0, "zero"), (z0, tiny, "subnormal"), (tiny, mx, "normal"), (mx, hi, "overflow")):
        ax.axvspan(a, b, color=_ZONES[zone], zorder=0, lw=0)
    for (a, b), label in (((lo, z0), "f16: becomes 0"), ((z0, tiny), "subnormal"), ((tiny, mx), "f16 normal range"),
                          ((mx, hi), "inf")):
        ax.text((a + b) / 2, 0.97, label, ha="center", va="top", fontsize=8, transform=ax.get_xaxis_transform(),
                zorder=4, bbox={"facecolor": "white", "alpha": 0.75, "lw": 0, "pad": 1.5})
    xs = [lo_exponent + i for i in used]
    ys = [100.0 * counts[i] / total for i in used]
    ax.bar(xs, ys, width=1.0, align="edge", color="#5f6368", alpha=0.85, label="fp32 gradients (scale 1)", zorder=2)
    if shift_bits:
        ax.step([x + shift_bits for x in xs] + [xs[-1] + shift_bits + 1] if xs else [], ys + ys[-1:] if ys else [],
                where="post", color="#1a73e8", lw=1.6, label=f"times the loss scale {shift_label}", zorder=3)
    ax.set_ylabel("% of gradient values")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.9), fontsize=8, framealpha=0.9)
    names = list(ranges)
    for row, name in enumerate(names):
        a, b = ranges[name]
        ax2.barh(row, b - a, left=a, height=0.55, color="#9aa0a6" if name != "f16" else "#34a853")
        ax2.text(max(a, lo) + 0.3, row, name, va="center", fontsize=8)
    ax2.set_yticks([])
    ax2.set_ylim(-0.7, len(names) - 0.3)
    ax2.set_xlim(lo, hi)
    ax2.set_xlabel("log2 |gradient|")
    ax2.set_title("representable range (smallest subnormal .. max)", fontsize=8, loc="left")
    fig.tight_layout()
    return figure_to_png(fig)


def bars_png(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    log: bool = False,
    limit: float | None = None,
    limit_label: str = "",
    empty_text: str = "every value is 0",
) -> bytes:
    """Grouped horizontal bars: one row per label, one bar per series; an optional vertical limit
    line. When every value is 0 the figure says ``empty_text`` instead of drawing an empty axis."""
    n = len(labels)
    if not any(v for values in series.values() for v in values):
        fig, ax = new_figure(width=9.0, height=2.0)
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes, fontsize=11)
        ax.set_title(title)
        ax.set_axis_off()
        fig.tight_layout()
        return figure_to_png(fig)
    k = max(len(series), 1)
    fig, ax = new_figure(width=9.0, height=max(2.2, 0.32 * n * k + 1.2))
    h = 0.8 / k
    for j, (name, values) in enumerate(series.items()):
        ax.barh([i + j * h for i in range(n)], values, height=h, label=name)
    ax.set_yticks([i + h * (k - 1) / 2 for i in range(n)])
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    if limit is not None:
        ax.axvline(limit, color="#d93025", lw=1.5, ls="--", label=limit_label or None)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    if len(series) > 1 or limit is not None:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return figure_to_png(fig)


def scale_history_png(scales: Sequence[float], skipped: Sequence[bool], *, title: str = "Loss scale per step") -> bytes:
    fig, ax = new_figure(width=8.0, height=3.2)
    steps = list(range(1, len(scales) + 1))  # step 1 is the first, as every text says
    ax.step(steps, scales, where="post", color="#1a73e8", lw=1.5, label="scale used")
    bad = [i + 1 for i in range(len(scales)) if skipped[i]]
    ax.scatter(bad, [scales[i - 1] for i in bad], color="#d93025", zorder=3, s=22, label="skipped (overflow)")
    ax.set_yscale("log", base=2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_to_png(fig)
