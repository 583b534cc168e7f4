"""The side-by-side measurement of ``compare --explain``: each module against fp32, on the same
weights and batch, and what a module adds alone (against rounding-error bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from compare_faults import make_underflow_task
from explain_tasks import FP16_SCALE1, make_variance_task
from mixprec.comparison.explain.capture import capture, unit_roundoff
from mixprec.comparison.explain.sidebyside import rel_error
from mixprec.comparison.runner import run_recipe
from mixprec.formats import get_format
from mixprec.recipes import resolve_recipe
from mixprec.tasks import Task, load_task

CPU = torch.device("cpu")


def test_rel_error_is_normwise_and_inf_only_where_the_recipe_alone_is_nonfinite():
    b = [torch.tensor([3.0, 4.0])]
    assert rel_error([torch.tensor([3.0, 4.0])], b) == 0.0
    assert rel_error([torch.tensor([3.0, 5.0])], b) == pytest.approx(1 / 5)
    assert rel_error([torch.tensor([3.0, float("inf")])], b) == math.inf
    # where fp32 is non-finite too (a -inf mask) the entry is not the recipe's error
    masked = [torch.tensor([1.0, float("-inf")])]
    assert rel_error([torch.tensor([1.0, float("-inf")])], masked) == 0.0
    assert math.isnan(rel_error([torch.zeros(3)], [torch.zeros(2)]))


def _linear_task() -> Task:
    x = torch.randn(32, 24, generator=torch.Generator().manual_seed(1)) + 0.5
    y = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    return Task("one-linear", build_model=lambda: nn.Sequential(nn.Linear(24, 8), nn.Tanh()),
                get_batch=lambda step: (x, y), loss_fn=nn.functional.mse_loss, steps=4, max_grad_norm=None)


@pytest.mark.parametrize("recipe", ["bf16-mixed", "fp16-mixed"])
def test_a_linear_alone_adds_no_more_than_its_rounding_error_bound(recipe):
    # y = fl(fl(x) fl(W)^T + fl(b)): each operand rounded (<= u), fp32 accumulation over K terms
    # (<= K 2^-24 of sum |x||w|), the result rounded (<= u): a bound per element, in float64
    task = _linear_task()
    cap = capture(task, resolve_recipe(recipe, CPU), CPU, [0])
    torch.manual_seed(0)
    model = task.build_model()
    x, _ = task.get_batch(0)
    w, b = model[0].weight.detach().double(), model[0].bias.detach().double()
    x = x.double()
    u, u32 = unit_roundoff(resolve_recipe(recipe, CPU).compute_dtype), 2.0**-24
    y = x @ w.T + b
    k = x.shape[1]
    bound = (2 * u + u * u + k * u32 * (1 + u) ** 2) * (x.abs() @ w.abs().T) + u * b.abs() + u * (1 + 3 * u) * y.abs()
    limit = float(bound.norm() / y.norm())
    lin = cap.module("0")
    assert lin.type == "Linear" and lin.out_dtype == ("bf16" if recipe == "bf16-mixed" else "f16")
    assert 0 < lin.added <= limit, (lin.added, limit)
    assert lin.fwd_in == 0.0  # it received fp32's batch exactly


def test_the_planted_16bit_variance_is_where_the_error_enters():
    task = make_variance_task()
    cap = capture(task, resolve_recipe("bf16-mixed", CPU), CPU, [0])
    entry = cap.entry_points()
    assert entry and entry[0].name == "blocks.1.std"
    std = cap.module("blocks.1.std")
    assert std.added > 0.5  # its output is wrong by half its size: cancellation, not rounding
    assert std.fwd_in < 4 * cap.unit_roundoff  # what it received was fine
    # the healthy modules around it add about one rounding each
    for name in ("inp", "blocks.0.fc", "blocks.2.fc", "head"):
        assert cap.module(name).added < 4 * cap.unit_roundoff, name
    # the recipe's own islands (the LayerNorms of the other blocks) are marked and add nothing
    assert cap.module("blocks.0.std").island and cap.module("blocks.0.std").added <= 2 * cap.unit_roundoff
    # the reduction ran in bf16 in its own code: the evidence for "a reduction in 16 bits"
    assert any(r.module == "blocks.1.std" and r.op == "mean" and r.dtype == "bf16" for r in cap.reductions)


def test_fp16_gradients_that_underflow_at_a_low_scale_are_counted_as_flushed():
    task = make_underflow_task(steps=4)
    low = capture(task, FP16_SCALE1, CPU, [0])
    dyn = capture(task, resolve_recipe("fp16-mixed", CPU), CPU, [0])
    assert low.scales == [1.0] and dyn.scales == [2.0**16]
    first = low.module("0")
    assert first.flushed > 0.9  # most of its gradient entries are zero in fp16 at scale 1
    assert dyn.module("0").flushed < 0.01
    # the scale that fits fp32's gradients: the largest power of two keeping the largest one under
    # half of fp16's max, at most 2^24 (the largest here is ~4e-6: the cap holds)
    half = get_format(torch.float16).max / 2
    assert low.fit_scale * low.grad_max <= half
    assert low.fit_scale == 2.0**24 or 2 * low.fit_scale * low.grad_max > half


def test_stored_weights_without_masters_keep_a_fraction_of_the_update_and_masters_all_of_it():
    task = load_task("fragile", steps=4)
    pure = capture(task, resolve_recipe("bf16-pure", CPU), CPU, [1])
    true = capture(task, resolve_recipe("bf16-true", CPU), CPU, [1])
    assert pure.module("").kept < 0.8
    assert true.module("").kept == pytest.approx(1.0, abs=1e-9)  # fp32 masters take the update exactly


def test_the_capture_run_reproduces_the_comparisons_run_bit_for_bit():
    task = make_variance_task(steps=6)
    rec = resolve_recipe("bf16-mixed", CPU)
    run = run_recipe(task, rec, steps=6, device=CPU)
    cap = capture(task, rec, CPU, [0, 3, 5], expected_loss=run.loss)
    assert cap.reproduced is True and cap.steps == [1, 4, 6]
    np.testing.assert_array_equal(np.asarray(cap.losses), run.loss)


def test_an_fp16_overflow_is_traced_to_the_op_in_the_modules_own_code():
    from explain_tasks import make_attention_task

    cap = capture(make_attention_task(steps=2), resolve_recipe("fp16-mixed", CPU), CPU, [0])
    attn = cap.module("attn")
    assert attn.made_nonfinite and cap.entry_points()[0] is attn
    # q @ k^T in Attention.forward itself, not a child: the logits pass 65504
    assert attn.nonfinite_op.startswith("matmul -> f16")
    assert not cap.module("attn.q").made_nonfinite and not cap.module("attn.k").made_nonfinite
