"""``MixedPrecision.load_state_dict`` is all or nothing: a state it refuses leaves every live object
bit-identical (scaler, masters, the 16-bit model, fp8 scaling state, the step counters).

Found by a probe: an fp16-true state saved from a 16-wide model, loaded into an 8-wide run, raised
"master-weight state does not fit" after the scaler had already taken the checkpoint's scale
(65536 -> 1024); ``"steps": "abc"`` did the same. The scaler was loaded before the rest was checked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision


def _run(recipe, width=8, steps=2, scale=2.0**16, **kw):
    torch.manual_seed(0)
    width *= 4 if recipe.startswith("fp8") else 1  # (fp8 GEMMs need dims that are multiples of 16)
    opts = {"scaler": {"init_scale": scale}} if recipe.startswith("fp16") else {}
    mp = MixedPrecision(recipe, "cpu", **opts, **kw)
    model = mp.prepare(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width)))
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    for _ in range(steps):
        with mp.autocast():
            loss = model(torch.randn(4, width)).float().pow(2).mean()
        mp.step(loss, opt)
    return mp, model


def _snapshot(mp, model):
    """Every piece of live state a load could touch, copied (tensors cloned, bit for bit)."""
    def copied(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, (int, float, str, bool, type(None))):
            return v
        return repr(type(v))

    snap = {"scaler": {k: copied(v) for k, v in vars(mp.scaler).items()},
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "counters": (mp._steps, mp._micro, mp._loss_sum)}
    if mp.masters is not None:
        snap["masters"] = copy.deepcopy(mp.masters.state_dict())
        snap["proxies"] = [s.proxy.detach().clone() for s in mp.masters.slots]
    if mp.fp8 is not None:
        snap["fp8"] = copy.deepcopy(mp.fp8.state_dict())
    return snap


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _bad_states(recipe, good):
    """(why, state) pairs, each with a good scaler part first (which the old code applied) then a bad part."""
    scaled = copy.deepcopy(good)
    if scaled["scaler"]:
        scaled["scaler"]["scale"] = 1024.0
    cases = [("steps a string", {**scaled, "steps": "abc"}), ("steps negative", {**scaled, "steps": -3}),
             ("steps a float", {**scaled, "steps": 2.5})]
    if good["scaler"]:  # (a recipe without loss scaling ignores the scaler part)
        cases.append(("scaler damaged", {**good, "scaler": {"scale": 8.0}}))
    if "masters" in good:
        wider, _ = _run(recipe, width=16, steps=3, scale=2.0**10)
        cases += [("masters of a wider model", {**wider.state_dict(), "recipe": good["recipe"]}),
                  ("masters not a dict", {**scaled, "masters": [1, 2]}),
                  ("masters of another strategy", {**scaled, "masters": {**good["masters"], "kind": "other"}})]
        if "generators" in good["masters"]:
            cases.append(("a damaged generator", {**scaled, "masters": {**good["masters"],
                                                                          "generators": {"cpu": torch.zeros(3, dtype=torch.uint8)}}}))
    if "fp8" in good:
        layers = copy.deepcopy(good["fp8"]["layers"])
        name = next(iter(layers))
        layers[name]["scale"] = torch.zeros_like(layers[name]["scale"])
        cases += [("fp8 scale zero", {**scaled, "fp8": {**good["fp8"], "layers": layers}}),
                  ("fp8 not a dict", {**scaled, "fp8": "abc"})]
    return cases


RECIPES = [("fp16-mixed", {}), ("fp16-true", {}), ("bf16-true", {}), ("bf16-true-kahan", {}), ("bf16-true-sr", {}),
           ("bf16-true-remainder", {}), ("fp8-delayed", {"fp8": {"amax_history_len": 4, "skip_first_last": False}})]


@pytest.mark.parametrize("recipe, kw", RECIPES, ids=[r for r, _ in RECIPES])
def test_a_refused_state_leaves_every_live_object_bit_identical(recipe, kw):
    mp, model = _run(recipe, **kw)
    good = _run(recipe, steps=3, scale=2.0**10, **kw)[0].state_dict()
    for why, bad in _bad_states(recipe, good):
        before = _snapshot(mp, model)
        with pytest.raises((ValueError, TypeError)):
            mp.load_state_dict(bad)
        assert _same(before, _snapshot(mp, model)), f"{recipe}: {why} changed live state"
    mp.load_state_dict(good)  # and a good one still loads, whole
    assert mp._steps == 3 and (not good["scaler"] or mp.scaler.get_scale() == good["scaler"]["scale"])
    if "masters" in good:
        assert _same(mp.masters.state_dict()["params"], good["masters"]["params"])


def test_a_custom_scaler_whose_load_raises_is_put_back():
    """A scaler with its own load_state_dict is not checked ahead: if it raises part-way, it is restored."""
    from mixprec import GradScaler

    class Partial(GradScaler):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            if state_dict.get("scale") == 1024.0:
                raise RuntimeError("custom scaler refuses after loading")

    torch.manual_seed(0)
    mp = MixedPrecision("fp16-mixed", "cpu", scaler=Partial("cpu", init_scale=2.0**16))
    model = mp.prepare(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mp.autocast():
        loss = model(torch.randn(2, 4)).float().pow(2).mean()
    mp.step(loss, opt)
    state = mp.state_dict()
    state["scaler"]["scale"], state["steps"] = 1024.0, 7
    with pytest.raises(RuntimeError, match="custom scaler refuses"):
        mp.load_state_dict(state)
    assert mp.scaler.get_scale() == 2.0**16 and mp._steps == 1


def test_a_failure_while_applying_puts_back_the_parts_applied_before_it(monkeypatch):
    """Faults as they happen: the masters' write raising after the scaler was loaded (an out-of-memory,
    say) puts the scaler back."""
    mp, model = _run("fp16-true")
    good = _run("fp16-true", steps=3, scale=2.0**10)[0].state_dict()

    def boom(state):
        raise MemoryError("out of memory while writing the masters")

    monkeypatch.setattr(mp.masters, "load_state_dict", boom)
    with pytest.raises(MemoryError):
        mp.load_state_dict(good)
    assert mp.scaler.get_scale() == 2.0**16 and mp._steps == 2
