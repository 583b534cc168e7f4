"""What the figures show: no band below zero for a loss that cannot be negative, annotations that
do not overprint, a plain sentence instead of an empty chart."""

from __future__ import annotations

import numpy as np
import pytest

from mixprec.report.doctor_plots import bars_png


@pytest.fixture(scope="module")
def fragile_result():
    from mixprec import compare
    from mixprec.tasks import load_task

    return compare(load_task("fragile", steps=24), ("bf16-pure", "fp16-pure"), threads=1)


def test_the_noise_band_stops_at_zero_for_a_nonnegative_loss_and_failures_are_stacked(fragile_result):
    from mixprec.comparison.verdict import ema
    from mixprec.report.compare_plots import comparison_figure

    r = fragile_result
    # widen the band so that it would reach below zero
    band = r.band
    band.lower[:] = -1.0
    fig = comparison_figure(r, lambda x: ema(x, 5), "EMA span 5")
    ax = fig.axes[0]
    ys = np.concatenate([p.get_paths()[0].vertices[:, 1] for p in ax.collections if p.get_label() == "fp32 noise band"])
    assert ys.min() >= 0.0
    notes = [t for t in ax.texts if "DIVERGES" in t.get_text()]
    assert len(notes) == 2 and len({t.xyann for t in notes}) == 2  # stacked, not on top of each other


def test_an_all_zero_bar_chart_says_so_in_words():
    empty = bars_png(["a", "b"], {"scale 1": [0.0, 0.0]}, title="t", xlabel="x", empty_text="nothing underflows")
    full = bars_png(["a", "b"], {"scale 1": [1.0, 0.0]}, title="t", xlabel="x")
    assert empty[:8] == b"\x89PNG\r\n\x1a\n" and len(empty) < len(full)
