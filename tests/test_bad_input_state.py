"""Bad input to the stateful objects and the step, as a new user gives it: a clear error that names
what is wrong and leaves the object as it was, or the right thing done. Each case once seen accepted
silently, or failing later with another library's words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import GradScaler, MixedPrecision


def _good_state():
    s = GradScaler("cpu", init_scale=2.0**10, hysteresis=2, min_scale=1.0)
    s.scale(torch.ones(()))
    return s.state_dict()


def _with(**changes):
    state = _good_state()
    for key, value in changes.items():
        if key.startswith("mixprec_"):
            state["mixprec"][key.removeprefix("mixprec_")] = value
        else:
            state[key] = value
    return state


SCALER_STATE_CASES = [
    ("scale is a string", _with(scale="big"), ValueError, "state_dict['scale'] must be a number, got str 'big'"),
    ("scale is zero", _with(scale=0.0), ValueError, "state_dict['scale'] must be > 0"),
    ("scale is inf", _with(scale=float("inf")), ValueError, "must be finite"),
    ("scale is NaN", _with(scale=float("nan")), ValueError, "must be finite"),
    ("growth factor below 1", _with(growth_factor=0.5), ValueError, "growth_factor'] must be > 1.0"),
    ("backoff factor of 1", _with(backoff_factor=1.0), ValueError, "backoff_factor'] must be in (0, 1)"),
    ("growth interval 0", _with(growth_interval=0), ValueError, "growth_interval'] must be an integer >= 1"),
    ("tracker negative", _with(_growth_tracker=-1), ValueError, "_growth_tracker'] must be an integer >= 0"),
    ("tracker a float", _with(_growth_tracker=1.5), ValueError, "_growth_tracker'] must be an integer >= 0"),
    ("a key missing", {"scale": 8.0}, ValueError, "not a GradScaler state dict: missing 'growth_factor'"),
    ("extras damaged", _with(mixprec={"hysteresis": 2}), ValueError, "is not mixprec's scaler extras"),
    ("hysteresis 0", _with(mixprec_hysteresis=0), ValueError, "['hysteresis'] must be an integer >= 1"),
    ("floor above scale", _with(mixprec_min_scale=2.0**20), ValueError, "is below min_scale"),
    ("unknown on_floor", _with(mixprec_on_floor="explode"), ValueError, "on_floor must be 'raise', 'warn' or 'skip'"),
    ("not a dict", [1, 2], TypeError, "expects the dict scaler.state_dict() returned"),
]


@pytest.mark.parametrize("why, state, error, fragment", SCALER_STATE_CASES, ids=[c[0] for c in SCALER_STATE_CASES])
def test_a_bad_scaler_state_is_refused_whole_and_leaves_the_scaler_as_it_was(why, state, error, fragment):
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))  # live: load_state_dict would write into its device tensors
    before = s.state_dict()
    with pytest.raises(error) as info:
        s.load_state_dict(state)
    assert fragment in str(info.value)
    assert s.state_dict() == before and s.get_scale() == 4.0


def test_good_scaler_states_still_load_from_mixprec_and_from_torch():
    s = GradScaler("cpu")
    s.load_state_dict(_good_state())
    assert s.get_scale() == 2.0**10 and s.state_dict()["mixprec"]["hysteresis"] == 2
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0)
    theirs.scale(torch.ones(()))
    s2 = GradScaler("cpu")
    s2.load_state_dict(theirs.state_dict())
    assert s2.get_scale() == 512.0 and isinstance(s2.get_scale(), float)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda0", ""])
def test_a_device_torch_does_not_know_is_refused(device):
    with pytest.raises(ValueError, match=f"GradScaler device {device!r} is not a torch device type"):
        GradScaler(device)


def test_known_device_types_are_accepted_as_torch_accepts_them():
    for device in ("cpu", torch.device("cpu"), "cuda:0", "xpu"):
        GradScaler(device, enabled=False)


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-mixed", "fp32", "bf16-true"])
def test_an_optimizer_over_another_module_is_named_for_every_recipe(recipe):
    # bf16-mixed and fp32 used to "step" it silently (the model never trained); fp16-mixed raised
    # torch's "No inf checks were recorded for this optimizer"
    mp = MixedPrecision(recipe, "cpu")
    model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    opt = torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)
    with mp.autocast():
        loss = model(torch.ones(2, 4)).float().sum()
    with pytest.raises(ValueError, match="holds none of the parameters of the prepared Sequential"):
        mp.step(loss, opt)


def test_an_extra_optimizer_beside_the_models_is_fine():
    mp = MixedPrecision("fp16-mixed", "cpu")
    model = mp.prepare(nn.Linear(4, 2))
    extra = nn.Parameter(torch.ones(2))
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([extra], lr=0.1)]
    with mp.autocast():
        loss = (model(torch.ones(2, 4)).float() * extra).sum()
    assert mp.step(loss, opts).stepped
