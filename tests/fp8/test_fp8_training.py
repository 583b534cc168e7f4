"""Training with the fp8 recipes: state in mp.state_dict() and bitwise resume, skipped steps, accumulation."""

from __future__ import annotations

import pytest
import torch

from fp8_helpers import FP8_RECIPES, build, roundtrip, train
from mixprec.fp8 import fp8_layers

SHORT = {"amax_history_len": 4}  # short enough that the history turns over inside the test


def _opts(recipe):
    return SHORT if recipe == "fp8-delayed" else {}


def _fp8_state(model):
    return {n: (m.fp8_amax_history.clone(), m.fp8_scale.clone()) for n, m in fp8_layers(model)
            if hasattr(m, "fp8_scale")}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_resume_from_a_checkpoint_continues_bit_for_bit(recipe):
    model, mp, opt = build(recipe, fp8=_opts(recipe))
    train(model, mp, opt, range(0, 6))
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()})
    train(model, mp, opt, range(6, 11))

    model2, mp2, opt2 = build(recipe, seed=1, fp8=_opts(recipe))  # another init: all of it must come from ckpt
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    mp2.load_state_dict(ckpt["mp"])
    train(model2, mp2, opt2, range(6, 11))
    for (n, p), (_, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, p2), n
    for n, (h, s) in _fp8_state(model).items():
        h2, s2 = _fp8_state(model2)[n]
        assert torch.equal(h, h2) and torch.equal(s, s2), n
    if recipe == "fp8-delayed":
        assert set(ckpt["mp"]["fp8"]["layers"]) == {n for n, _ in fp8_layers(model)}
        # without the fp8 state (scales back at 1) the same continuation is another run
        model3, mp3, opt3 = build(recipe, seed=1, fp8=SHORT)
        model3.load_state_dict(ckpt["model"])
        opt3.load_state_dict(ckpt["opt"])
        train(model3, mp3, opt3, range(6, 11))
        assert not all(torch.equal(p, p3) for p, p3 in zip(model.parameters(), model3.parameters()))
    else:
        assert ckpt["mp"]["fp8"] == {"scaling": "current", "layers": {}}  # current scaling keeps no state


def test_a_skipped_step_pushes_nothing_into_the_histories():
    model, mp, opt = build("fp8-delayed", skip_nonfinite=True, fp8=SHORT)
    train(model, mp, opt, range(3))
    before = _fp8_state(model)
    params = [p.detach().clone() for p in model.parameters()]
    train(model, mp, opt, range(3, 4), poison={3})  # inf loss: inf/NaN gradients, the step is skipped
    assert mp.scaler.was_skipped()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after = _fp8_state(model)
    for n, (h, s) in before.items():
        assert torch.equal(after[n][0], h) and torch.equal(after[n][1], s), n  # slot 0 emptied, nothing rolled
        assert torch.isfinite(after[n][0]).all()
    train(model, mp, opt, range(4, 5))  # the next clean step advances them as usual
    for n, (h, _) in before.items():
        assert torch.equal(_fp8_state(model)[n][0][1:-1], h[2:]) and (_fp8_state(model)[n][0][-1] > 0).all()


def test_without_skipping_a_nonfinite_step_leaves_the_history_as_transformer_engine_would():
    model, mp, opt = build("fp8-delayed", fp8=SHORT)  # bf16-mixed has no scaler: the step is taken
    train(model, mp, opt, range(2))
    before = {n: (h.clone(), s.clone()) for n, (h, s) in _fp8_state(model).items()}
    train(model, mp, opt, range(2, 3), poison={2})
    for n, (h, s) in _fp8_state(model).items():
        # inf times the loss: inf - inf in the bf16 head makes every fp8 layer's output gradient all NaN, whose
        # amax TE's fmaxf computes as 0: that role does not roll (the others do) and keeps its scale
        assert torch.equal(h[:, 2], before[n][0][:, 2]) and (h[-1, :2] > 0).all(), n
        assert not torch.isnan(h).any() and s[2] == before[n][1][2], n


def test_an_infinite_output_gradient_enters_the_history_and_keeps_the_scale():
    from fp8_helpers import fp8_linear
    from mixprec.fp8.delayed import update

    lin = fp8_linear(32, 16, scaling="delayed", history=4)
    for poisoned in (False, True):
        g = torch.full((8, 16), 1e-3)
        if poisoned:
            g[2, 3] = float("inf")
        lin(torch.randn(8, 32)).backward(g)
        scale = lin.fp8_scale.clone()
        update([lin.fp8_amax_history], [lin.fp8_scale], lin.fp8_config.formats, "max", 0)
    assert lin.fp8_amax_history[-1, 2] == float("inf") and lin.fp8_scale[2] == scale[2]  # as TE: kept L steps


def test_accumulation_fills_one_history_slot_per_optimizer_step():
    model, mp, opt = build("fp8-delayed", accumulate=2, fp8=SHORT)
    train(model, mp, opt, range(2))  # two micro-batches, one optimizer step
    for n, (h, _) in _fp8_state(model).items():
        assert (h[:-1] == 0).all() and (h[-1] > 0).all(), n  # rolled once: one entry per role
    train(model, mp, opt, range(2, 3))  # inside a window: nothing rolls
    for n, (h, _) in _fp8_state(model).items():
        assert (h[1:-1] == 0).all() and (h[0] > 0).all(), n


def test_state_dict_errors_say_what_to_do():
    model, mp, opt = build("fp8-delayed", fp8=SHORT)
    train(model, mp, opt, range(1))
    state = mp.state_dict()
    from mixprec import MixedPrecision

    fresh = MixedPrecision("fp8-delayed", "cpu", fp8=SHORT)
    with pytest.raises(RuntimeError, match="call mp.prepare"):
        fresh.load_state_dict(state)
    other, mp_other, _ = build("fp8-delayed", fp8={"amax_history_len": 8})
    with pytest.raises(ValueError, match="a different amax_history_len"):
        mp_other.load_state_dict(state)
    _, mp_excl, _ = build("fp8-delayed", fp8={**SHORT, "exclude": ("blocks.1.*",)})
    with pytest.raises(ValueError, match="prepare the same model with the same fp8 options"):
        mp_excl.load_state_dict(state)
    _, mp_cur, _ = build("fp8-current")
    with pytest.raises(ValueError, match="'delayed' scaling, this recipe uses 'current'"):
        mp_cur.load_state_dict({**state, "recipe": "fp8-current"})
