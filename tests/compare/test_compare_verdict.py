"""The verdict rule on synthetic curves: smoothing, the band, and each status."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mixprec.comparison.verdict import VerdictRule, ema, first_run, fp32_band, judge, rolling_max

STEPS = 200


@dataclasses.dataclass
class Curve:
    label: str
    loss: np.ndarray
    recipe: str = ""
    loss_scaling: str = "none"
    scale: np.ndarray = dataclasses.field(default_factory=lambda: np.ones(STEPS))
    skipped: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(STEPS, dtype=bool))
    error: str | None = None

    def __post_init__(self) -> None:
        self.recipe = self.recipe or self.label


def _fp32_family(seed_offsets=(0.03, -0.04), n=STEPS, noise=0.01, rng_seed=0):
    """A falling loss curve; 'other seeds' differ by an offset that decays as training converges."""
    rng = np.random.default_rng(rng_seed)
    t = np.arange(n)
    base = 2.5 + 2.0 * np.exp(-t / 30)
    batch_noise = noise * rng.standard_normal(n)  # the same batches in every run: shared noise
    ref = base + batch_noise
    others = [base + off * (1 + np.exp(-t / 50)) + batch_noise + 0.002 * rng.standard_normal(n) for off in seed_offsets]
    return ref, others


def _band():
    ref, others = _fp32_family()
    return ref, fp32_band(ref, others, VerdictRule())


def test_ema_of_constant_is_constant_and_span_one_is_identity():
    np.testing.assert_allclose(ema(np.full(10, 3.0), 7), 3.0)
    x = np.array([1.0, 5.0, -2.0, 4.0])
    np.testing.assert_array_equal(ema(x, 1), x)


def test_ema_matches_recurrence_started_at_first_value():
    x = np.array([1.0, 2.0, 4.0])
    a = 2 / (3 + 1)
    expected = [1.0, 1.0 + a * (2 - 1.0)]
    expected.append(expected[-1] + a * (4 - expected[-1]))
    np.testing.assert_allclose(ema(x, 3), expected)


def test_rolling_max_is_centred_and_shrinks_at_ends():
    x = np.array([0, 0, 5, 0, 0, 0, 0], dtype=float)
    np.testing.assert_array_equal(rolling_max(x, 3), [0, 5, 5, 5, 0, 0, 0])


def test_first_run_needs_consecutive_steps_after_start():
    mask = np.array([1, 1, 0, 1, 1, 1, 0], dtype=bool)
    assert first_run(mask, 3) == 3
    assert first_run(mask, 2) == 0
    assert first_run(mask, 2, start=1) == 3
    assert first_run(mask, 4) is None


def test_band_is_factor_times_largest_seed_gap_with_floor():
    ref, others = _fp32_family()
    rule = VerdictRule(factor=3.0, floor=0.0).resolve(STEPS)
    band = fp32_band(ref, others, rule)
    gaps = np.max([np.abs(ema(o, rule.span) - ema(ref, rule.span)) for o in others], axis=0)
    np.testing.assert_allclose(band.noise_gap, rolling_max(gaps, rule.span))
    np.testing.assert_allclose(band.width, 3.0 * band.noise_gap)
    # a floor of 10% of the loss dominates these ~1-8% gaps
    floored = fp32_band(ref, others, VerdictRule(floor=0.10))
    np.testing.assert_allclose(floored.width, 0.10 * floored.center)


def test_band_needs_noise_runs():
    with pytest.raises(ValueError, match="at least one fp32 run"):
        fp32_band(np.ones(10), [], VerdictRule())


def test_candidate_with_rounding_noise_tracks():
    ref, band = _band()
    cand = ref + 1e-3 * np.random.default_rng(1).standard_normal(STEPS)  # far below the seed gap
    v = judge(Curve("bf16-mixed", cand), band)
    assert v.status == "TRACKS" and v.ok
    assert v.first_step is None and v.ratio < 0.5


def test_curve_that_stops_falling_diverges_from_the_step_it_leaves_the_band():
    ref, band = _band()
    cand = ref.copy()
    cand[80:] = cand[80]  # learning stops at step 81 (as when gradients flush to zero)
    v = judge(Curve("fp16-noscale", cand), band)
    assert v.status == "DIVERGES" and not v.ok
    assert 80 < v.first_step < 120  # the smoothed gap needs a while to outgrow the band
    assert v.gap > 0 and v.ratio > 1 and "above" in v.message
    assert f"step {v.first_step}" in v.message


def test_curve_well_below_fp32_also_diverges_and_says_below():
    ref, band = _band()
    v = judge(Curve("odd", ref - 0.5), band)
    assert v.status == "DIVERGES" and v.gap < 0 and "below" in v.message


def test_excursion_shorter_than_patience_is_tolerated():
    ref, others = _fp32_family()
    r_band = fp32_band(ref, others, VerdictRule(span=1, patience=10))  # no smoothing: the spike's length is exact
    spiked = ref.copy()
    spiked[100:105] += 1.0  # 5 steps out of band
    assert judge(Curve("spiky", spiked), r_band).status == "TRACKS"
    spiked[100:112] += 1.0  # 12 steps out of band
    v = judge(Curve("spiky", spiked), r_band)
    assert v.status == "DIVERGES" and v.first_step == 101


def test_warmup_steps_are_not_judged():
    ref, others = _fp32_family()
    early = ref.copy()
    early[:15] += 1.0
    late_start = fp32_band(ref, others, VerdictRule(span=1, warmup=20, patience=5))
    assert judge(Curve("early", early), late_start).status == "TRACKS"
    no_warmup = fp32_band(ref, others, VerdictRule(span=1, warmup=0, patience=5))
    assert judge(Curve("early", early), no_warmup).status == "DIVERGES"


def test_non_finite_reports_first_step_and_scale_history():
    ref, band = _band()
    loss = ref.copy()
    loss[57] = np.inf
    loss[60:] = np.nan
    scale = np.full(STEPS, 2.0**16)
    scale[40:] = 2.0**10
    skipped = np.zeros(STEPS, dtype=bool)
    skipped[[39, 57, 60]] = True
    v = judge(Curve("fp16-mixed", loss, loss_scaling="dynamic", scale=scale, skipped=skipped), band)
    assert v.status == "NON-FINITE" and v.first_step == 58
    assert v.scale == {
        "initial": 2.0**16, "min": 2.0**10, "max": 2.0**16, "final": 2.0**10,
        "skipped_steps": 3, "first_skipped_step": 40, "at_first_nonfinite": 2.0**10,
    }
    assert "step 58" in v.message and "1024" in v.message


def test_non_finite_without_scaler_has_no_scale_history():
    ref, band = _band()
    loss = ref.copy()
    loss[3] = np.nan
    v = judge(Curve("bf16-mixed", loss), band)
    assert v.status == "NON-FINITE" and v.first_step == 4 and v.scale is None


def test_candidate_that_raised_is_error():
    ref, band = _band()
    v = judge(Curve("fp16-mixed", ref[:10], error="fp16-mixed failed at step 10: RuntimeError: boom"), band)
    assert v.status == "ERROR" and "boom" in v.message and not v.ok


def test_too_short_to_judge_is_unjudged():
    ref, others = _fp32_family()
    v = judge(Curve("short", ref[:5]), fp32_band(ref, others, VerdictRule(warmup=10)))
    assert v.status == "UNJUDGED" and not v.ok


def test_rule_resolves_defaults_from_steps_and_states_them():
    r = VerdictRule().resolve(200)
    assert (r.span, r.patience, r.warmup) == (10, 10, 10)
    assert VerdictRule().resolve(10_000).span == 50
    short = VerdictRule().resolve(8)  # a short run is still judged on most of its steps
    assert (short.span, short.patience, short.warmup) == (5, 2, 2)
    text = VerdictRule(factor=2.5).describe(200)
    for fragment in ("span 10", "2.5 x", "1%", "10 consecutive steps", "NON-FINITE", "DIVERGES", "TRACKS"):
        assert fragment in text


@pytest.mark.parametrize("kwargs", [{"span": 0}, {"factor": 0.0}, {"floor": -0.1}, {"patience": 1.5}])
def test_rule_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError, match="VerdictRule"):
        VerdictRule(**kwargs)
