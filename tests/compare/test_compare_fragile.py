"""The shipped 'fragile' task shows what a failure looks like: unsafe recipes DIVERGE, safe ones TRACK."""

import pytest

from mixprec import compare
from mixprec.tasks import TaskError, load_task


def test_fragile_task_fails_fp16_without_scaling_and_bf16_storage_without_masters():
    task = load_task("fragile", steps=40)
    result = compare(task, ("fp16-mixed", "bf16-true", "bf16-pure", "fp16-pure"), threads=1)
    status = {name: v.status for name, v in result.verdicts.items()}
    assert status == {"fp16-mixed": "TRACKS", "bf16-true": "TRACKS", "bf16-pure": "DIVERGES", "fp16-pure": "DIVERGES"}
    # and the reason is the one the task's docstring gives: they barely move from the start
    start = result.reference.loss[0]
    assert result.reference.loss[-1] < 0.5 * start
    for name in ("bf16-pure", "fp16-pure"):
        assert result.run_for(name).loss[-1] > 0.75 * start


def test_builtin_tasks_load_by_short_name_and_bad_arguments_are_named():
    assert load_task("charlm", steps=3).name == "charlm"
    assert load_task("fragile").name == "fragile"
    with pytest.raises(ValueError, match="loss_weight must be a number > 0"):
        load_task("fragile", loss_weight=0)
    with pytest.raises(TaskError, match="built-in task: charlm, fragile"):
        load_task("nosuchtask")
