"""model.load_state_dict after prepare reaches the masters (a pretrained checkpoint loaded into a
prepared model, a resume that forgot mp.load_state_dict): the next step trains from the loaded
weights, for every 16-bit storage recipe, exactly as if the model had been prepared from them."""

from __future__ import annotations

import copy

import pytest
import torch
from masters_helpers import STORAGE_RECIPES, assert_bitwise_equal, tiny_gpt, train

from mixprec import MixedPrecision


def _mp(recipe: str) -> MixedPrecision:
    return MixedPrecision(recipe, "cpu", **({} if recipe == "fp16-true" else {"skip_nonfinite": True}))


def _opt(mp, model):
    return torch.optim.AdamW(mp.parameters(model), lr=3e-3, weight_decay=0.1)


@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
def test_loading_a_checkpoint_after_prepare_trains_as_preparing_it_would(recipe):
    ckpt = copy.deepcopy(tiny_gpt(seed=0).state_dict())  # an fp32 checkpoint (pretrained weights)
    direct_mp = _mp(recipe)
    direct = direct_mp.prepare(tiny_gpt(seed=0))
    loaded_mp = _mp(recipe)
    other = tiny_gpt(seed=7)  # other weights at prepare...
    torch.manual_seed(0)  # (stochastic rounding seeds its generator from the global seed at prepare)
    loaded = loaded_mp.prepare(other)
    loaded.load_state_dict(ckpt)  # ...then the checkpoint
    assert_bitwise_equal(direct_mp.masters.masters(), loaded_mp.masters.masters(), "masters after the load")
    assert_bitwise_equal(direct.state_dict(), loaded.state_dict(), "16-bit model after the load")
    o1, o2 = _opt(direct_mp, direct), _opt(loaded_mp, loaded)
    train(direct, direct_mp, o1, range(3))
    train(loaded, loaded_mp, o2, range(3))
    assert_bitwise_equal(direct_mp.masters.masters(), loaded_mp.masters.masters(), "masters after 3 steps")
    assert_bitwise_equal(direct.state_dict(), loaded.state_dict(), "model after 3 steps")


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true", "bf16-true-remainder"])
def test_exact_masters_take_the_checkpoints_fp32_values_not_their_16_bit_rounding(recipe):
    ckpt = tiny_gpt(seed=0).state_dict()
    mp = _mp(recipe)
    model = mp.prepare(tiny_gpt(seed=7))
    model.load_state_dict(ckpt)
    for name, master in mp.masters.masters().items():
        assert torch.equal(master, ckpt[name]), name


@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
def test_mp_state_after_or_before_the_model_both_resume_exactly(recipe):
    model, mp = tiny_gpt(), _mp(recipe)
    model = mp.prepare(model)
    opt = _opt(mp, model)
    train(model, mp, opt, range(2))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()})
    train(model, mp, opt, range(2, 4))
    for order in ("model-first", "mp-first"):
        ckpt = copy.deepcopy(saved)  # torch's optimizer load keeps the given tensors: a fresh copy per run
        mp2 = _mp(recipe)
        m2 = mp2.prepare(tiny_gpt(seed=5))
        o2 = _opt(mp2, m2)
        if order == "model-first":
            m2.load_state_dict(ckpt["model"])
            mp2.load_state_dict(ckpt["mp"])
        else:  # the model's own 16-bit values coming back must not overwrite the exact masters
            mp2.load_state_dict(ckpt["mp"])
            m2.load_state_dict(ckpt["model"])
        o2.load_state_dict(ckpt["opt"])
        train(m2, mp2, o2, range(2, 4))
        assert_bitwise_equal(mp.masters.masters(), mp2.masters.masters(), order)
        assert_bitwise_equal(model.state_dict(), m2.state_dict(), order)


def test_a_partial_load_sets_only_the_loaded_masters():
    mp = _mp("bf16-true")
    model = mp.prepare(tiny_gpt(seed=7))
    before = mp.masters.masters()
    ckpt = tiny_gpt(seed=0).state_dict()
    model.load_state_dict({"head.weight": ckpt["head.weight"]}, strict=False)
    after = mp.masters.masters()
    assert torch.equal(after["head.weight"], ckpt["head.weight"])
    assert all(torch.equal(after[n], before[n]) for n in before if n != "head.weight")


def test_loading_in_the_middle_of_a_step_is_refused():
    mp = MixedPrecision("bf16-true", "cpu", accumulate=1)
    model = mp.prepare(tiny_gpt())
    mp.masters.stepping = True  # between the boundary's backward and the optimizer step
    with pytest.raises(RuntimeError, match="in the middle of a mixprec step"):
        model.load_state_dict(tiny_gpt(seed=3).state_dict())
