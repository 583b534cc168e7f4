"""Parameters frozen at prepare (a fine-tune's base): 16 bits, no master, no gradient, no state."""

from __future__ import annotations

import pytest
import torch
from masters_helpers import STORAGE_RECIPES, assert_bitwise_equal, assert_resume_bitwise, batch, tiny_gpt, train
from torch import nn

from mixprec import MixedPrecision
from mixprec.memory import ParamCounts, StorageFacts, facts_from_recipe, plan
from mixprec.memory.measure import count_params, measure_step
from mixprec.recipes import get_recipe
from mixprec.tasks import load_task
from mixprec.tasks.charlm import lm_loss


def frozen_base(seed: int = 0) -> nn.Module:
    """The tiny GPT with its block's attention and MLP frozen (an adapter-style fine-tune)."""
    model = tiny_gpt(seed)
    for name, p in model.named_parameters():
        if name.startswith("blocks.0.") and "ln" not in name:
            p.requires_grad_(False)
    return model


def setup_frozen(recipe: str, **kw):
    mp = MixedPrecision(recipe, "cpu", **kw)
    model = mp.prepare(frozen_base())
    return model, mp, torch.optim.AdamW(mp.parameters(model), lr=3e-3, weight_decay=0.1)


@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
def test_frozen_parameters_are_stored_in_16_bits_without_masters(recipe):
    model, mp, opt = setup_frozen(recipe)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad} - set(mp.masters.fp32_names)
    assert frozen and {n for n, _ in mp.masters.frozen} == frozen  # frozen biases stay fp32 (the rule)
    assert all(p.dtype == mp.masters.storage_dtype for n, p in model.named_parameters() if n in frozen)
    assert not frozen & {s.name for s in mp.masters.slots}
    assert not frozen & set(mp.state_dict()["masters"]["params"])
    assert "frozen tensors" in mp.describe()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    train(model, mp, opt, range(4), poison={2}, max_grad_norm=1.0)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]) and p.grad is None
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(opt.state[p] for n, p in mp.named_parameters(model) if n in trained)


def test_bf16_true_with_a_frozen_base_trains_bitwise_like_bf16_mixed():
    # In bf16-mixed the frozen fp32 weights are cast to bf16 in every forward; bf16-true stores
    # that same rounding once. The trainable parameters must come out bit for bit the same.
    runs = []
    for recipe in ("bf16-mixed", "bf16-true"):
        model, mp, opt = setup_frozen(recipe)
        train(model, mp, opt, range(5), max_grad_norm=1.0)
        # the trainable values: bf16-mixed's fp32 weights, bf16-true's fp32 masters
        runs.append({n: p.detach() for n, p in mp.named_parameters(model) if p.requires_grad})
    assert_bitwise_equal(runs[0], runs[1])


@pytest.mark.parametrize("recipe", ["bf16-true", "bf16-true-sr", "bf16-true-remainder"])
def test_resume_with_a_frozen_base_continues_bit_for_bit(recipe):
    assert_resume_bitwise(lambda: setup_frozen(recipe), range(3), range(3, 6))


def test_unfreezing_after_prepare_is_refused_before_any_update():
    model, mp, opt = setup_frozen("bf16-true")
    name, p = mp.masters.frozen[0]
    p.requires_grad_(True)
    before = p.detach().clone()
    x, y = batch(0)
    with mp.autocast():
        loss = lm_loss(model(x), y)
    with pytest.raises(RuntimeError, match=rf"{name!r} was frozen \(requires_grad=False\)"):
        mp.step(loss, opt)
    assert torch.equal(p, before)


def test_the_optimizer_guard_refuses_a_frozen_weight_that_got_a_gradient():
    model, mp, _ = setup_frozen("bf16-true")
    name, p = mp.masters.frozen[0]
    opt = torch.optim.SGD([p], lr=0.1)  # a hand-made optimizer over a frozen 16-bit weight
    p.requires_grad_(True)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="has no fp32 master"):
        opt.step()


def test_plan_counts_no_gradient_state_or_master_for_frozen_parameters():
    facts = facts_from_recipe(get_recipe("bf16-true"))
    p = plan(ParamCounts(1000, frozen=900), facts, "adamw")
    assert p.bytes["weights"] == 2 * 1000
    assert p.bytes["masters"] == 4 * 100 and p.bytes["optimizer state"] == 8 * 100
    assert p.bytes["gradients"] == 2 * 100 and p.bytes["step-time fp32"] == 4 * 100
    mixed = plan(ParamCounts(1000, frozen=900), StorageFacts("bf16-mixed", 4, 2, autocast=True), "adamw")
    assert mixed.bytes["gradients"] == 4 * 100 and mixed.bytes["optimizer state"] == 8 * 100
    with pytest.raises(ValueError, match="frozen"):
        ParamCounts(10, frozen=11)
    with pytest.raises(ValueError, match="frozen"):
        ParamCounts(10, fp32_kept=2, frozen=5, frozen_fp32_kept=3)


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "bf16-true", "bf16-true-kahan"])
def test_plan_matches_measured_bytes_with_a_frozen_base(recipe):
    task = load_task(None, batch_size=4, seq_len=32, d_model=64, n_layer=2, n_head=4)
    build = task.build_model

    def build_frozen():
        model = build()
        for name, p in model.named_parameters():
            if name.startswith("blocks.0."):  # a frozen layer, norms (kept fp32) included
                p.requires_grad_(False)
        return model

    task.build_model = build_frozen
    measured = measure_step(task, recipe, "adamw", "cpu")
    counts = measured.counts
    assert counts.frozen > 0 and (counts.frozen_fp32_kept > 0) == get_recipe(recipe).stores_16bit
    p = plan(counts, facts_from_recipe(get_recipe(recipe)), "adamw")
    for comp in ("weights", "gradients", "masters", "step-time fp32"):
        assert measured.bytes[comp] == p.bytes[comp], comp
    trainable_tensors = sum(1 for q in build_frozen().parameters() if q.requires_grad)
    assert measured.bytes["optimizer state"] == p.bytes["optimizer state"] + 4 * trainable_tensors


def test_count_params_sees_frozen_parameters():
    counts = count_params(frozen_base(), get_recipe("bf16-true"))
    model = frozen_base()
    assert counts.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad) > 0
