"""The hypotheses' rules on synthetic runs: when fp32 counts as unstable, and which loss-scale
changes are proposed for which scale history (no training)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import torch

from mixprec.comparison.explain.capture import Capture
from mixprec.comparison.explain.hypotheses import fp32_stability, scale_candidates
from mixprec.comparison.verdict import VerdictRule, fp32_band
from mixprec.recipes import get_recipe


def _comparison(curves: list[np.ndarray]):
    runs = [types.SimpleNamespace(label=f"fp32 (seed {i})" if i else "fp32", role="noise" if i else "reference", loss=c)
            for i, c in enumerate(curves)]
    band = fp32_band(curves[0], curves[1:], VerdictRule())
    return types.SimpleNamespace(runs=runs, band=band)


STEPS = np.arange(100)


def test_fp32_seeds_that_start_apart_and_settle_together_are_stable():
    # seeds differ by their initial weights (at step 1 by more than training moves the reference's
    # loss) and converge alike: not instability
    curves = [1.0 * np.exp(-STEPS / 10) + 0.5 + 0.8 * i * np.exp(-STEPS / 5) for i in range(3)]
    assert fp32_stability(_comparison(curves)).status == "REJECTED"


def test_fp32_seeds_that_end_as_far_apart_as_training_moved_the_loss_are_unstable():
    curves = [1.0 * np.exp(-STEPS / 20) + 1.0 + 0.6 * i for i in range(3)]  # moved by 1, apart by 1.2 at the end
    f = fp32_stability(_comparison(curves))
    assert f.status == "HOLDS" and "the model, not the format" in f.conclusion


def test_a_fp32_loss_that_rises_is_unstable_and_a_nonfinite_one_names_its_step():
    rising = [0.5 + 0.02 * STEPS + 0.001 * i for i in range(3)]
    assert fp32_stability(_comparison(rising)).status == "HOLDS"
    bad = [np.r_[np.ones(10), np.full(90, np.nan)], np.ones(100), np.ones(100)]
    comp = types.SimpleNamespace(runs=_comparison([np.ones(100)] * 3).runs, band=None)
    comp.runs[0].loss = bad[0]
    f = fp32_stability(comp)
    assert f.status == "HOLDS" and "step 11" in f.conclusion


def _capture(**kw) -> Capture:
    base = dict(recipe="fp16-mixed", compute="f16", unit_roundoff=2**-11, steps=[1], modules=[], output_dtype="f32",
                loss_dtype="f32", reductions=[], scales=[2.0**6], grad_max=1e-3, fit_scale=2.0**24, flushed=0.4,
                losses=[], reproduced=True, notes=[], wall_s=0.0)
    return Capture(**{**base, **kw})


def test_a_dynamic_scale_that_backed_off_and_stayed_low_gets_a_larger_initial_scale_and_a_faster_growth():
    run = types.SimpleNamespace(scale=np.array([2.0**16] * 2 + [2.0**6] * 98), skipped=np.r_[[True] * 10, [False] * 90])
    ev, cands = scale_candidates(get_recipe("fp16-mixed"), run, _capture(), horizon=100)
    changes = {c.change.split(" (")[0]: c for c in cands}
    assert "initial scale 2^24" in changes  # the scale that fits fp32's gradients is far above where it started
    grow = next(c for c in cands if "growth_interval" in c.change)
    assert grow.mp_options == {"scaler": {"growth_interval": 10}}
    assert grow.code(get_recipe("fp16-mixed")) == "MixedPrecision('fp16-mixed', scaler={'growth_interval': 10})"
    assert any(c.hypothesis == "format" and c.recipe.compute_dtype == torch.bfloat16 for c in cands)
    assert any("lowest 2^6" in line and "10 of 100 steps skipped" in line for line in ev)


def test_bf16_recipes_get_no_scale_candidates_and_static_ones_get_dynamic_scaling():
    run = types.SimpleNamespace(scale=np.ones(10), skipped=np.zeros(10, dtype=bool))
    assert scale_candidates(get_recipe("bf16-mixed"), run, _capture(compute="bf16"), 10) == ([], [])
    static = dataclasses.replace(get_recipe("fp16-mixed"), name="s1", loss_scaling="static", static_scale=1.0)
    _, cands = scale_candidates(static, run, _capture(), 10)
    assert [c.change for c in cands][:2] == ["dynamic loss scaling", "static loss scale 2^24 (fits fp32's gradients)"]
    assert cands[0].code(static) == "MixedPrecision('fp16-mixed')"
