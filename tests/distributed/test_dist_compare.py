"""``mixprec compare --nproc 2``: every run data-parallel through torchrun, the same verdicts as one process.

The two runs of a recipe see the same global batches; they differ only in the order the batch's
gradient is summed (per rank, then over the ranks), so their curves differ by rounding, far
inside fp32's seed-to-seed band, and the verdicts agree."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mixprec import compare
from mixprec_test_env import src_env

SMALL = {"d_model": 16, "n_layer": 1, "n_head": 2, "batch_size": 8, "seq_len": 16}
RECIPES = ("fp32", "bf16-mixed", "fp16-mixed")


def _verdicts(result):
    return {k: v.status for k, v in result.verdicts.items()}


def test_two_processes_give_the_verdicts_of_one_on_the_built_in_task():
    one = compare(None, RECIPES, steps=60, task_kwargs=SMALL, threads=1)
    two = compare(None, RECIPES, steps=60, task_kwargs=SMALL, threads=1, nproc=2, timeout=240)
    assert _verdicts(two) == _verdicts(one) == {"bf16-mixed": "TRACKS", "fp16-mixed": "TRACKS"}
    for a, b in zip(one.runs, two.runs, strict=True):
        assert a.label == b.label and len(b.loss) == 60
        # rounding only: orders of magnitude inside the band (whose floor alone is 1% of the loss)
        assert np.abs(a.loss - b.loss).max() < 1e-3 * np.abs(a.loss).max()


def test_nproc_needs_a_task_the_processes_can_import():
    from mixprec.tasks import TaskError, load_task

    with pytest.raises(TaskError, match="module:function"):
        compare(load_task(None, **SMALL), RECIPES, steps=10, nproc=2)


@pytest.mark.slow
def test_the_command_with_nproc_2_on_the_default_built_in_task_agrees_with_one_process(tmp_path):
    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "mixprec", "compare", "--json", "--quiet", "--out", "", *extra],
                             capture_output=True, text=True, env=src_env(), timeout=900)
        assert out.returncode in (0, 1), out.stderr[-3000:]
        return json.loads(out.stdout)

    one, two = run(), run("--nproc", "2")
    assert {k: v["status"] for k, v in two["verdicts"].items()} == {k: v["status"] for k, v in one["verdicts"].items()}
