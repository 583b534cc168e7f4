"""compare() and one run: arguments, task protocol errors, ERROR / UNJUDGED, progress, threads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import compare_bad_tasks as bad
from mixprec import get_recipe
from mixprec.comparison.api import compare
from mixprec.comparison.runner import RunError, run_recipe
from mixprec.tasks import TaskError

CPU = {"device": "cpu"}


def test_public_names_are_exported_and_compare_stays_a_function():
    import mixprec.comparison.api  # noqa: F401  (a subpackage named 'compare' would shadow the function)

    assert callable(mixprec.compare) and mixprec.compare is compare
    for name in ("ComparisonResult", "Verdict", "VerdictRule"):
        assert name in mixprec.__all__ and getattr(mixprec, name).__name__ == name


def test_recipe_objects_and_aliases_are_accepted_and_deduplicated():
    noscale = dataclasses.replace(get_recipe("fp16-mixed"), name="fp16-noscale", loss_scaling="none")
    with pytest.warns(UserWarning, match="'bf16' and 'bf16-mixed' name the same recipe"):
        result = compare(bad.healthy(), ("bf16", "bf16-mixed", noscale, "32-true"), **CPU)
    assert list(result.verdicts) == ["bf16-mixed", "fp16-noscale"]  # fp32 is the reference, not a candidate
    assert result.run_for("fp16-noscale").loss_scaling == "none"
    assert len(result.runs) == 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seeds": 1}, "at least 2"),
        ({"steps": 1}, "steps=1"),
        ({"recipes": ("fp32",)}, "only fp32"),
        ({"recipes": ("bf61-mixed",)}, "Unknown recipe 'bf61-mixed'"),
        ({"threads": 0}, "threads=0"),
        ({"task_kwargs": {"width": 3}}, "a ready Task takes none"),
    ],
)
def test_bad_arguments_fail_before_any_training(kwargs, match):
    kwargs = {"recipes": ("bf16-mixed",), **kwargs}
    with pytest.raises(ValueError, match=match):
        compare(bad.healthy(), **kwargs, **CPU)


def test_task_kwargs_reach_the_factory():
    result = compare(bad.sized, ("bf16-mixed",), task_kwargs={"width": 7}, steps=3, **CPU)
    assert result.steps == 3
    with pytest.raises(TaskError, match="does not accept arguments"):
        compare(bad.sized, ("bf16-mixed",), task_kwargs={"depth": 7}, **CPU)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (bad.not_a_task, "returned dict, expected mixprec.tasks.Task"),
        (bad.model_is_not_a_module, "build_model\\(\\) returned str, expected a torch.nn.Module"),
        (bad.batch_is_not_a_pair, "expected a pair \\(inputs, targets\\)"),
        (bad.batches_follow_the_global_seed, "different batches under different global seeds"),
        (bad.loss_is_not_a_scalar, "step 0 under 'fp32'.*scalar loss"),
    ],
)
def test_tasks_that_break_the_protocol_get_clear_errors(factory, match):
    with pytest.raises(TaskError, match=match):
        compare(factory, ("bf16-mixed",), **CPU)


def test_recipe_that_fails_on_this_device_is_error_and_others_still_judged():
    result = compare(bad.fails_under_autocast(), ("bf16-mixed", "fp16-mixed"), **CPU)
    for name in ("bf16-mixed", "fp16-mixed"):
        v = result.verdicts[name]
        assert v.status == "ERROR" and "failed at step 0" in v.message and "not implemented for 'Half'" in v.message
    assert not result.ok and result.run_for("bf16-mixed").steps == 0


def test_fp32_failure_raises_run_error_naming_run_and_step():
    with pytest.raises(RunError, match=r"fp32 failed at step 0: RuntimeError"):
        run_recipe(bad.fails_under_autocast(), "bf16-mixed", role="reference", label="fp32")


def test_non_finite_fp32_leaves_every_recipe_unjudged_and_skips_them():
    result = compare(bad.nan_in_fp32(), ("bf16-mixed", "fp16-mixed"), **CPU)
    assert {v.status for v in result.verdicts.values()} == {"UNJUDGED"}
    assert "fp32 itself" in result.verdicts["bf16-mixed"].message and "not the precision" in result.verdicts["bf16-mixed"].message
    assert [r.role for r in result.runs] == ["reference"]  # nothing else was trained
    assert result.runs[0].stopped is not None and result.runs[0].steps == 10
    assert not result.ok and result.band is None
    assert result.to_dict()["band"] is None  # the report still works


def test_progress_and_run_callbacks_and_threads_are_restored():
    torch.set_num_threads(2)
    seen_threads, steps, runs = set(), [], []
    result = compare(
        bad.healthy(), ("bf16-mixed",), steps=4, threads=1, **CPU,
        progress=lambda label, done, total, loss: (steps.append((label, done, total)), seen_threads.add(torch.get_num_threads())),
        on_run=lambda label, i, n: runs.append((label, i, n)),
    )
    assert runs == [("fp32", 0, 4), ("fp32 (seed 1)", 1, 4), ("fp32 (seed 2)", 2, 4), ("bf16-mixed", 3, 4)]
    assert steps[:4] == [("fp32", k, 4) for k in (1, 2, 3, 4)] and len(steps) == 16
    assert seen_threads == {1} and torch.get_num_threads() == 2
    assert result.threads == 1 and result.to_dict()["threads"] == 1
    assert result.ok


def test_storage_recipes_train_their_fp32_masters_and_track():
    """bf16-true's optimizer must see the fp32 masters: built over mp.parameters(model)."""
    result = compare(bad.healthy(), ("bf16-true",), **CPU)
    assert result.verdicts["bf16-true"].status == "TRACKS"
    run = result.run_for("bf16-true")
    assert run.error is None and bool(torch.isfinite(torch.as_tensor(run.loss)).all())
