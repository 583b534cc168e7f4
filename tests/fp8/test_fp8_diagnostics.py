"""Diagnostics on fp8 models: the guard names a saturating fp8 layer, the probes and doctor report each cast."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import mixprec
from fp8_helpers import batch, build, fp8_linear, tiny_gpt
from mixprec import MixedPrecision
from mixprec.diagnostics.fp8_watch import Fp8SaturationWarning
from mixprec.diagnostics.probes.fp8 import probe_fp8_casts
from mixprec.fp8 import CastObserver, fp8_layers
from mixprec.fp8.casts import E4M3, amax, current_scale, quantize
from mixprec.tasks.charlm import lm_loss, make_task


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def _spiky_steps(mp, net, opt, spike_at: int, steps: int = 4):
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (40.0 if step == spike_at else 1.0)
        with mp.autocast():
            loss = net(x).float().square().mean()
        mp.step(loss, opt)


def test_the_guard_names_an_fp8_layer_that_saturates_and_warns_once():
    net = _mlp()
    mp = MixedPrecision("fp8-delayed", "cpu", nan_guard="warn", fp8={"amax_history_len": 4})
    mp.prepare(net)
    opt = torch.optim.SGD(mp.parameters(net), lr=1e-3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _spiky_steps(mp, net, opt, spike_at=3)
    assert rec and all(issubclass(w.category, Fp8SaturationWarning) for w in rec)
    assert any(re.match(r"fp8 layer 2: \d+ of 512 input values .* saturated in e4m3", str(w.message)) for w in rec)
    sat = [s for s in mp.guard.fp8_saturations if s.step == 4 and s.role == "input"]
    assert sat and sat[0].layer == "2" and sat[0].fraction > 0.1  # the spike, cast with the quiet steps' scale
    assert all(s.layer == "2" for s in mp.guard.fp8_saturations)  # only the fp8 layer (0 and 4 stay bf16)
    assert len([w for w in rec if "2:" in str(w.message) and "input" in str(w.message)]) == 1
    assert "fp8 layer 2" in mp.guard.summary()
    mp.guard.detach()
    assert net[2].fp8_observers == ()  # no trace left on the model


def test_the_guard_in_record_mode_records_without_warning_and_current_scaling_saturates_nothing():
    net = _mlp()
    mp = MixedPrecision("fp8-current", "cpu", nan_guard="record")
    mp.prepare(net)
    opt = torch.optim.SGD(mp.parameters(net), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _spiky_steps(mp, net, opt, spike_at=2)
    assert mp.guard.fp8_saturations == []


def test_the_guard_names_the_fp8_layer_that_turns_an_inf_into_nan():
    model = tiny_gpt()
    mp = MixedPrecision("fp8-current", "cpu", nan_guard="record")
    mp.prepare(model)
    x, _ = batch(0)
    with torch.no_grad():
        model.blocks[0].ln2.bias.fill_(float("inf"))  # block 0's fc (fp8) receives inf: 448/inf = a 0 scale
    with mp.autocast():
        model(x)
    ev = next(e for e in mp.guard.events if e.origin == "producer")
    assert ev.kind == "nan" and ev.module == "blocks.0.fc" and ev.module_type == "Fp8Linear"


def test_the_observer_counts_what_the_cast_does():
    x = torch.randn(64, 32) * torch.logspace(-8, 1, 32)  # columns from tiny to large
    s = current_scale(amax(x), E4M3)
    q = quantize(x, s, E4M3)
    lin = fp8_linear(32, 16)
    with CastObserver(lin) as obs:
        lin(x)
        stats = {c.role: c for c in obs.read()}
    c = stats["input"]
    assert c.numel == x.numel() and c.nonzero == int((x != 0).sum())
    assert c.zeros == int(((q.float() == 0) & (x != 0)).sum()) > 0  # the tiny columns flush
    assert c.saturated == 0 and c.scale == pytest.approx(float(s)) and c.amax == pytest.approx(float(amax(x)))
    expected = 10 * torch.log10(x.double().square().sum() / (x.double() - q.double() / s).square().sum())
    assert c.sqnr_db == pytest.approx(float(expected), rel=1e-6)


def test_probe_grad_underflow_reports_every_fp8_cast_and_leaves_no_trace():
    model, mp, opt = build("fp8-delayed", fp8={"amax_history_len": 4})
    x, y = batch(0)
    state = {n: m.fp8_amax_history.clone() for n, m in fp8_layers(model)}
    with mp.autocast():
        lm_loss(model(x), y).backward()
    mp.fp8.after_step(None)
    state = {n: (m.fp8_amax_history.clone(), m.fp8_scale.clone()) for n, m in fp8_layers(model)}
    for p in model.parameters():
        p.grad = None
    report = mixprec.probe_grad_underflow(model, lambda: lm_loss(model(x), y))
    got = {(c.layer, c.role) for c in report.fp8}
    assert got == {(n, r) for n, _ in fp8_layers(model) for r in ("input", "weight", "grad_output")}
    assert all(c.sqnr_db > 15 for c in report.fp8)
    assert report.to_dict()["fp8"][0]["layer"] == report.fp8[0].layer
    for n, m in fp8_layers(model):  # the probe's own forward and backward left the scaling state alone
        assert torch.equal(m.fp8_amax_history, state[n][0]) and torch.equal(m.fp8_scale, state[n][1])
    assert all(p.grad is None for p in model.parameters())
    assert mixprec.probe_grad_underflow(tiny_gpt(), lambda: torch.ones(1, requires_grad=True).sum()).fp8 == []


def test_probe_fp8_casts_sees_unscaled_gradients_flush():
    model, mp, _ = build("fp8-unscaled")
    x, y = batch(0)
    stats = probe_fp8_casts(model, lambda: lm_loss(model(x), y), autocast=mp.autocast)
    grads = [c for c in stats if c.role == "grad_output"]
    assert grads and max(c.zero for c in grads) > 0.9 and min(c.sqnr_db for c in grads) < 5
    inputs = [c for c in stats if c.role == "input"]
    assert min(c.sqnr_db for c in inputs) > 25


TINY = make_task(d_model=16, n_layer=1, n_head=2, seq_len=16, batch_size=4)


@pytest.mark.parametrize("recipe, status", [("fp8-current", "ok"), ("fp8-unscaled", "alarm")])
def test_doctor_reports_the_fp8_casts(recipe, status):
    report = mixprec.doctor(TINY, recipe=recipe, device="cpu", steps=1)
    f = next(f for f in report.findings if f.check == "fp8-casts")
    assert f.status == status, f.summary
    assert any("grad_output" in e for e in f.evidence)
    if status == "alarm":
        assert "flushed to 0" in f.summary and "exclude" in f.fix


def test_doctor_on_a_recipe_without_fp8_says_so():
    report = mixprec.doctor(TINY, recipe="bf16-mixed", device="cpu", steps=1)
    f = next(f for f in report.findings if f.check == "fp8-casts")
    assert f.status == "ok" and "nothing in fp8" in f.summary


def test_observers_compose_each_sees_every_cast_and_each_is_removed_alone():
    lin = fp8_linear(32, 16)
    x = torch.randn(8, 32)
    a, b = CastObserver(lin).attach(), CastObserver(lin, full=False).attach()
    a.attach()  # twice is once
    assert len(lin.fp8_observers) == 2
    lin(x).sum().backward()
    ra, rb = a.read(), b.read()
    assert [(c.role, c.numel, c.zeros, c.saturated) for c in ra] == [(c.role, c.numel, c.zeros, c.saturated) for c in rb]
    assert {c.role for c in ra} == {"input", "weight", "grad_output"} and ra[0].casts == 1
    a.detach()
    lin(x).sum().backward()
    assert a.read() == [] and len(b.read()) == 3  # b still watches
    b.detach()
    assert lin.fp8_observers == ()


@pytest.mark.parametrize("probe", ["probe_fp8_casts", "probe_grad_underflow", "probe_activation_range"])
def test_a_probe_leaves_the_guards_fp8_watch_on(probe):
    # issue 28.2: after one probe the guard's watch was gone, and a x4000 spike 38 steps later went unrecorded
    net = _mlp()
    mp = MixedPrecision("fp8-delayed", "cpu", nan_guard="record", fp8={"amax_history_len": 4})
    mp.prepare(net)
    opt = torch.optim.SGD(mp.parameters(net), lr=1e-3)
    _spiky_steps(mp, net, opt, spike_at=-1, steps=3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(99))
    closure = lambda: net(x).float().square().mean()  # noqa: E731
    if probe == "probe_fp8_casts":
        assert probe_fp8_casts(net, closure, autocast=mp.autocast)
    elif probe == "probe_grad_underflow":
        assert mixprec.probe_grad_underflow(net, closure).fp8
    else:
        mixprec.probe_activation_range(net, closure)
    assert len(net[2].fp8_observers) == 1  # the guard's, and only it
    before = len(mp.guard.fp8_saturations)
    _spiky_steps(mp, net, opt, spike_at=0, steps=1)  # a x40 spike: cast with the quiet steps' scale, it saturates
    new = mp.guard.fp8_saturations[before:]
    assert new and new[0].layer == "2" and new[0].role == "input" and new[0].fraction > 0.1
