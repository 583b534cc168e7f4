"""End to end: planted precision faults must fail the comparison; the healthy recipes must track.

Each task is tiny (a few seconds for five runs). See ``compare_faults`` for how each fault works.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from compare_faults import (
    LOSS_WEIGHT,
    make_overflow_task,
    make_underflow_task,
    make_vanishing_task,
)
from mixprec import get_recipe
from mixprec.comparison.api import compare
from mixprec.comparison.runner import run_recipe
from mixprec.comparison.verdict import VerdictRule, fp32_band, judge
from mixprec.formats import get_format

FP16_NOSCALE = dataclasses.replace(get_recipe("fp16-mixed"), name="fp16-noscale", loss_scaling="none")


def test_underflow_task_premise_early_gradients_are_below_fp16_floor():
    # The fault is real only if fp32 gradients would flush in fp16: check against the format table.
    task = make_underflow_task()
    torch.manual_seed(0)
    model = task.build_model()
    x, y = task.get_batch(0)
    task.loss_fn(model(x), y).backward()
    flush_below = get_format("f16").smallest_subnormal / 2  # round to nearest: below half flushes to 0
    first = model[0].weight.grad.abs()
    assert (first < flush_below).float().mean() > 0.9
    assert (first > 0).all()  # in fp32 they are small, not zero
    assert LOSS_WEIGHT < 1


@pytest.fixture(scope="module")
def underflow_result():
    return compare(make_underflow_task(), (FP16_NOSCALE, "fp16-mixed", "bf16-mixed"), device="cpu", threads=1)


def test_fp16_without_loss_scaling_diverges_when_gradients_underflow(underflow_result):
    v = underflow_result.verdicts["fp16-noscale"]
    assert v.status == "DIVERGES", v.message
    assert v.gap > 0  # it learns less: the loss stays above fp32's
    assert v.ratio > 2
    assert not underflow_result.ok


def test_dynamic_loss_scaling_rescues_the_same_underflow(underflow_result):
    # the scaler is what makes the difference: same task, same fp16 compute, with scaling
    assert underflow_result.verdicts["fp16-mixed"].status == "TRACKS", underflow_result.verdicts["fp16-mixed"].message
    assert underflow_result.verdicts["bf16-mixed"].status == "TRACKS"


def test_bf16_weights_without_fp32_masters_diverge_when_updates_vanish():
    healthy, no_masters = make_vanishing_task(), make_vanishing_task(masters=False)
    ref = run_recipe(healthy, "fp32", seed=0, role="reference")
    noise = [run_recipe(healthy, "fp32", seed=s, role="noise") for s in (1, 2)]
    band = fp32_band(ref.loss, [n.loss for n in noise], VerdictRule())
    bad = run_recipe(no_masters, "bf16-mixed", seed=0, label="bf16, no fp32 masters")
    v = judge(bad, band)
    assert v.status == "DIVERGES", v.message
    assert v.gap > 0 and v.ratio > 2
    # and the premise: the rounded weights barely moved, fp32's did
    assert bad.loss[-20:].mean() > 0.95 * bad.loss[:5].mean()
    assert ref.loss[-20:].mean() < 0.9 * ref.loss[:5].mean()


def test_fp16_forward_overflow_is_non_finite_with_scale_history():
    result = compare(make_overflow_task(), ("bf16-mixed", "fp16-mixed"), device="cpu", threads=1)
    v = result.verdicts["fp16-mixed"]
    assert v.status == "NON-FINITE" and v.first_step == 1
    # the scaler halved the scale at every skipped step, which cannot help a forward overflow
    assert v.scale["initial"] == 2.0**16 and v.scale["min"] < v.scale["initial"]
    assert v.scale["skipped_steps"] == result.run_for("fp16-mixed").steps
    run = result.run_for("fp16-mixed")
    assert run.stopped is not None and run.steps < run.steps_requested  # stopped early, not 40 NaN steps
    assert np.all(np.diff(run.scale) < 0)
    assert result.verdicts["bf16-mixed"].status == "TRACKS"
    assert not result.ok
