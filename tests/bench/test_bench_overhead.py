"""The step-overhead comparison: both arms do the same work, and the op count is exact."""

import collections

import pytest
import torch

from mixprec.bench import overhead
from mixprec.bench.block import SHAPES

CPU = torch.device("cpu")


@pytest.mark.parametrize("recipe", ["fp32", "fp16-mixed"])
def test_mixprec_and_hand_loop_train_bitwise_identically(recipe):
    # fp16-mixed runs mixprec's GradScaler against torch.amp.GradScaler: same scales, same steps.
    doc = overhead.run_overhead(SHAPES["tiny"], CPU, recipe, rounds=3, warmup=1, arms=("mixprec", "hand", "hand-plain"))
    assert doc["recipe"] == recipe
    assert doc["max_param_diff_vs_hand"] == 0.0
    assert doc["ratio_iteration"]["n"] == 3
    assert set(doc["arms"]) == {"mixprec", "hand", "hand-plain"}
    assert "ratio_iteration_vs_plain" in doc
    assert doc["ops_per_step"]["mixprec"] > 10


def test_op_count_sees_one_extra_op_in_a_step():
    arm = overhead.Arm("hand", "fp32", SHAPES["tiny"], CPU, "foreach", 1.0, overhead.make_batches(SHAPES["tiny"], CPU))
    arm.iteration()  # AdamW creates its state on the first step
    base = overhead.step_ops(arm)
    real = arm._hand_step
    arm._hand_step = lambda loss: (real(loss), torch.ones(()).clone())
    more = overhead.step_ops(arm)
    assert overhead.op_difference(more, base) == {"aten.clone": 1, "aten.ones": 1}
    assert overhead.op_difference(base, base) == {}


def test_op_difference_reports_signed_counts():
    a = collections.Counter({"aten.add_": 2, "aten.mul": 1})
    b = collections.Counter({"aten.add_": 1, "aten.gt": 1})
    assert overhead.op_difference(a, b) == {"aten.add_": 1, "aten.gt": -1, "aten.mul": 1}


def test_overhead_needs_both_main_arms():
    with pytest.raises(ValueError, match="'mixprec' and 'hand'"):
        overhead.run_overhead(SHAPES["tiny"], CPU, "fp32", rounds=1, arms=("mixprec",))


def test_suite_reports_a_bad_recipe_and_keeps_the_rest():
    doc = overhead.run_overhead_suite(SHAPES["tiny"], CPU, ["fp32", "fp33"], ["foreach"], rounds=2, warmup=0)
    assert [r["status"] for r in doc["runs"]] == ["ok", "error"]
    assert "Unknown recipe 'fp33'" in doc["runs"][1]["error"]
    assert doc["kind"] == "mixprec-overhead"
