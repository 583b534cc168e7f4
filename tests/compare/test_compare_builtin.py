"""The built-in task: healthy recipes track fp32, and the loss falls clearly (the curve has shape)."""

from __future__ import annotations

import numpy as np
import pytest

from mixprec.comparison.api import compare
from mixprec.comparison.report import speedup_note, summary_rows
from mixprec.tasks import load_task


def test_healthy_recipes_track_fp32_on_the_shrunk_builtin_task(healthy_comparison):
    result = healthy_comparison
    assert set(result.verdicts) == {"bf16-mixed", "fp16-mixed"}
    for name, v in result.verdicts.items():
        assert v.status == "TRACKS", f"{name}: {v.message}"
        assert v.ratio < 0.5  # well inside the band, not at its edge
    assert result.ok


def test_noise_runs_vary_the_init_seed_only(healthy_comparison):
    result = healthy_comparison
    assert [r.seed for r in result.runs] == [0, 1, 2, 0, 0]
    assert [r.role for r in result.runs] == ["reference", "noise", "noise", "candidate", "candidate"]
    ref, noise = result.reference, result.noise
    # different initial weights give different first losses; the reference and its recipes share them
    assert all(abs(n.loss[0] - ref.loss[0]) > 1e-4 for n in noise)
    assert abs(result.run_for("bf16-mixed").loss[0] - ref.loss[0]) < 0.05


def test_records_every_step_of_every_run(healthy_comparison):
    for run in healthy_comparison.runs:
        n = healthy_comparison.steps
        assert run.steps == n and run.stopped is None and run.error is None
        for curve in (run.loss, run.grad_norm, run.scale, run.skipped, run.step_time_s):
            assert len(curve) == n
        assert np.isfinite(run.grad_norm).all() and (run.grad_norm > 0).all()
        assert (run.step_time_s > 0).all()
        assert run.peak_memory_bytes is None  # CPU: not measurable
    fp16 = healthy_comparison.run_for("fp16-mixed")
    assert fp16.loss_scaling == "dynamic" and fp16.scale[0] == 2.0**16
    assert (healthy_comparison.reference.scale == 1.0).all()


def test_step_time_ratio_is_relative_to_pooled_fp32(healthy_comparison):
    import dataclasses

    r = dataclasses.replace(healthy_comparison, timing=None)  # the sequential runs' figures
    fp32_median = np.median([x.median_step_s for x in r.runs if x.role != "candidate"])
    assert r.fp32_step_s == pytest.approx(fp32_median)
    assert r.step_time_ratio("bf16-mixed") == pytest.approx(r.run_for("bf16-mixed").median_step_s / fp32_median)
    # fp32 is the baseline: its row reads 1.00x and shows the pooled time the others divide by
    assert r.step_time_ratio("fp32") == 1.0
    row = next(x for x in summary_rows(r) if x["recipe"] == "fp32")
    assert row["speedup"] == 1.0 and row["step_ms"] == pytest.approx(fp32_median * 1e3)
    # the tables show speedups (> 1: faster), the inverse of the time ratio
    assert r.speedup("bf16-mixed") == pytest.approx(1 / r.step_time_ratio("bf16-mixed"))
    bf16 = next(x for x in summary_rows(r) if x["recipe"] == "bf16-mixed")
    assert bf16["speedup"] == pytest.approx(fp32_median / r.run_for("bf16-mixed").median_step_s)
    assert r.speed_method == "sequential" and "INDICATIVE ONLY" in speedup_note(r)


def test_the_speed_column_comes_from_interleaved_rounds(healthy_comparison):
    r = healthy_comparison
    assert r.speed_method == "interleaved" and set(r.timing) == {"fp32", "bf16-mixed", "fp16-mixed"}
    rounds = len(r.timing["fp32"])
    assert rounds == 10 and all(len(t) == rounds for t in r.timing.values())
    ratios = np.array(r.timing["fp32"]) / np.array(r.timing["bf16-mixed"])  # paired: the same round
    assert r.speedup("bf16-mixed") == pytest.approx(float(np.median(ratios)))
    row = next(x for x in summary_rows(r) if x["recipe"] == "bf16-mixed")
    lo, hi = row["speedup_ci"]
    assert lo <= row["speedup"] <= hi and row["step_ms"] == pytest.approx(np.median(r.timing["bf16-mixed"]) * 1e3)
    assert "interleaved rounds" in speedup_note(r)
    speed = r.to_dict()["speed"]
    assert speed["method"] == "interleaved" and speed["rounds"] == rounds
    assert speed["speedup_vs_fp32"]["bf16-mixed"]["median"] == pytest.approx(r.speedup("bf16-mixed"))


def test_the_report_names_the_threads_the_runs_used(healthy_comparison):
    # compare ran with threads=1 and restored the caller's setting; the page must say 1 in both places
    import re
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        page = healthy_comparison.write(str(healthy_comparison.files["html"]).rsplit("/", 1)[0])["html"]
        html = open(page).read()
    finally:
        torch.set_num_threads(before)
    assert "(torch threads 1)" in html
    assert re.findall(r"(\d+) threads, torch", html) == ["1"]
    assert healthy_comparison.to_dict()["machine"]["threads"] == 1


def test_builtin_default_loss_falls_clearly_within_a_few_dozen_steps():
    # the default size's curve must have shape: check its first 60 steps in fp32 (cheap)
    from mixprec.comparison.runner import run_recipe

    task = load_task(None)
    assert task.steps == 200 and "d=48" in task.description
    run = run_recipe(task, "fp32", steps=60)
    assert run.loss[:5].mean() > 4.0  # ~ln(96) = 4.56 at the start
    assert run.loss[-10:].mean() < 3.3


@pytest.mark.slow
def test_default_compare_tracks_on_the_full_builtin_task(tmp_path):
    # exactly what 'mixprec compare' runs with no arguments (about a minute on two cores)
    result = compare(device="cpu", out=str(tmp_path / "r"), threads=1)
    assert result.steps == 200 and len(result.runs) == 5
    for name, v in result.verdicts.items():
        assert v.status == "TRACKS", f"{name}: {v.message}"
    ref = result.reference.loss
    assert ref[-10:].mean() < 0.6 * ref[:3].mean()  # falls clearly: ~4.6 -> ~2.6
