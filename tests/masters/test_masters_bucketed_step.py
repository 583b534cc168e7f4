"""The compact strategies' step, a bucket at a time: the same numbers as one whole step, less memory."""

from __future__ import annotations

import warnings

import pytest
import torch
from masters_helpers import assert_bitwise_equal, setup, snapshot, train
from torch import nn

from mixprec import MixedPrecision
from mixprec.instruments.storage import LiveBytes
from mixprec.masters.base import MasterWeights

COMPACT = ["bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def _two_groups(make):
    """An optimizer over two param groups (decay / no decay), as most training scripts build."""
    def build(params):
        params = list(params)
        return make([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}])
    return build


OPTIMIZERS = {
    "adamw-foreach": lambda g: torch.optim.AdamW(g, lr=3e-3, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=3e-3, weight_decay=0.1, fused=True),
    "adam-amsgrad-single": lambda g: torch.optim.Adam(g, lr=3e-3, amsgrad=True, foreach=False),
    "sgd-nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5),
    "adamax": lambda g: torch.optim.Adamax(g, lr=3e-3),
    "nadam": lambda g: torch.optim.NAdam(g, lr=3e-3),
    "radam": lambda g: torch.optim.RAdam(g, lr=3e-3),
    "adadelta": lambda g: torch.optim.Adadelta(g, lr=1.0),
}


def _run(recipe, optimizer, bucketed, monkeypatch, steps=4, **mp_kwargs):
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)  # many buckets
    if not bucketed:
        monkeypatch.setattr(MasterWeights, "can_step_in_buckets", lambda self, opts: False)
    model, mp, opt = setup(recipe, optimizer=_two_groups(OPTIMIZERS[optimizer]), **mp_kwargs)
    seen = []
    handle = opt.register_step_pre_hook(lambda o, a, k: seen.append(mp.masters.in_buckets))
    train(model, mp, opt, range(steps), max_grad_norm=0.5)
    handle.remove()
    monkeypatch.undo()
    assert len(mp.masters.buckets) >= 5  # one per weight tensor of the tiny GPT
    return snapshot(model, mp, opt), seen


def _assert_unchanged(before, after):
    """Weights, optimizer state and the strategy's state (not the scaler's skip counters)."""
    for key in ("model", "opt"):
        assert_bitwise_equal(before[key], after[key], key)
    assert_bitwise_equal(before["mp"]["masters"], after["mp"]["masters"], "masters")


@pytest.mark.parametrize("recipe", COMPACT)
def test_a_bucket_at_a_time_is_bitwise_one_whole_step(recipe, monkeypatch):
    whole, seen_whole = _run(recipe, "adamw-foreach", False, monkeypatch, accumulate=2)
    parts, seen_parts = _run(recipe, "adamw-foreach", True, monkeypatch, accumulate=2)
    assert set(seen_whole) == {False} and set(seen_parts) == {True}
    assert len(seen_parts) > 4 * len(seen_whole)  # the optimizer really was stepped in parts
    assert_bitwise_equal(whole, parts)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_per_parameter_optimizer_steps_in_buckets_bitwise(optimizer, monkeypatch):
    whole, _ = _run("bf16-true-kahan", optimizer, False, monkeypatch, steps=3)
    parts, seen = _run("bf16-true-kahan", optimizer, True, monkeypatch, steps=3)
    assert set(seen) == {True}
    assert_bitwise_equal(whole, parts)


def test_fused_optimizer_overflow_skips_every_bucket_on_device(monkeypatch):
    # fp16 storage has no compact strategy; an inf loss under bf16 with skip_nonfinite takes the
    # same path: a fused optimizer gets found_inf and every bucket's step must be a no-op.
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
    make = lambda g: torch.optim.AdamW(g, lr=3e-3, fused=True)  # noqa: E731
    model, mp, opt = setup("bf16-true-kahan", optimizer=make, skip_nonfinite=True)
    train(model, mp, opt, range(1))
    before = snapshot(model, mp, opt)
    (stats,) = train(model, mp, opt, range(1, 2), poison={1})
    assert bool(stats.skipped)
    _assert_unchanged(before, snapshot(model, mp, opt))
    assert all(p.grad is None for p in mp.parameters(model))


@pytest.mark.parametrize("recipe", COMPACT)
def test_unfused_overflow_skips_without_rebuilding_anything(recipe, monkeypatch):
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
    model, mp, opt = setup(recipe, skip_nonfinite=True)
    train(model, mp, opt, range(1))
    before = snapshot(model, mp, opt)
    rebuilt = []
    inner = type(mp.masters)._materialize_bucket
    monkeypatch.setattr(type(mp.masters), "_materialize_bucket", lambda self, b: (rebuilt.append(b), inner(self, b)))
    (stats,) = train(model, mp, opt, range(1, 2), poison={1})
    assert bool(stats.skipped)
    if recipe == "bf16-true-sr":
        # stochastic rounding draws for every bucket, as a whole step does (the paths stay bitwise
        # the same); the values written back are unchanged
        assert rebuilt == mp.masters.buckets
        for key in ("model", "opt"):
            assert_bitwise_equal(before[key], snapshot(model, mp, opt)[key], key)
    else:
        assert rebuilt == []
        _assert_unchanged(before, snapshot(model, mp, opt))


def test_optimizers_that_may_look_across_parameters_step_whole(monkeypatch):
    class MyAdamW(torch.optim.AdamW):  # a subclass may do anything in step(): not cut into parts
        pass

    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
    model, mp, opt = setup("bf16-true-sr", optimizer=lambda g: MyAdamW(g, lr=3e-3))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(sum(len(g["params"]) for g in o.param_groups)))
    train(model, mp, opt, range(2))
    assert calls == [len(list(mp.parameters(model)))] * 2 and not mp.masters.in_buckets
    # two optimizers: one step each, whole
    model, mp, opt = setup("bf16-true-sr")
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with mp.autocast():
        loss = model(torch.zeros(2, 16, dtype=torch.long)).float().mean()
    mp.step(loss, [opt, opt2])
    assert not mp.masters.can_step_in_buckets([opt, opt2])


def test_lr_scheduler_sees_one_optimizer_step_and_keeps_its_wrapper(monkeypatch):
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
    model, mp, opt = setup("bf16-true-kahan")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = opt.__dict__.get("step")  # torch's schedulers wrap the instance's step to count calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        train(model, mp, opt, range(3), scheduler=sched)
    assert opt.__dict__.get("step") is wrapper
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5**3)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(mp.parameters(model)))


def test_the_step_holds_one_bucket_of_rebuilt_values_not_the_model(monkeypatch):
    n = 128 * 128
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", n)
    mp = MixedPrecision("bf16-true-sr", "cpu", fp32_params=())
    model = mp.prepare(nn.Sequential(*(nn.Linear(128, 128, bias=False) for _ in range(8))))
    opt = torch.optim.SGD(mp.parameters(model), lr=1e-3)
    step = mp.scaler.step
    peak = []

    def measured(optimizer, *args, **kwargs):
        with LiveBytes() as live:
            out = step(optimizer, *args, **kwargs)
        peak.append(live.peak / n)
        return out

    monkeypatch.setattr(mp.scaler, "step", measured)
    with mp.autocast():
        loss = model(torch.randn(4, 128)).float().pow(2).mean()
    mp.step(loss, opt)
    strategy = mp.masters
    # one bucket's fp32 gradients, values and temporaries at a time (bf16 has no loss scaler: the
    # 16-bit gradients wait on the model); a whole step would hold 8 buckets' gradients and values
    per_bucket = strategy.step_bytes + strategy.value_bytes
    assert peak and per_bucket <= peak[0] <= per_bucket + strategy.temp_bytes < 8 * per_bucket
    assert all(p.grad is None for p in mp.parameters(model))
    assert all(p.grad is None for p in model.parameters())


def _never_defer(monkeypatch):
    inner = MasterWeights.after_backward
    monkeypatch.setattr(MasterWeights, "after_backward",
                        lambda self, opts, boundary, defer=False: inner(self, opts, boundary, False))


@pytest.mark.parametrize("recipe", [*COMPACT, "bf16-true"])
@pytest.mark.parametrize("clip", [None, 0.05, 10.0])
def test_deferred_16bit_gradients_step_bitwise_like_fp32_gradients(recipe, clip, monkeypatch):
    # bf16 has no loss scaler: the gradients stay 16-bit until their bucket's turn; the clip's norm
    # is measured from them in fp32. Against folding every gradient to fp32 after backward.
    def run(defer):
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
        if not defer:
            _never_defer(monkeypatch)
        model, mp, opt = setup(recipe, optimizer=_two_groups(OPTIMIZERS["adamw-foreach"]), track_grad_norm=True)
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(mp.masters.deferred))
        stats = train(model, mp, opt, range(4), max_grad_norm=clip)
        monkeypatch.undo()
        return snapshot(model, mp, opt), [s.grad_norm for s in stats], seen

    folded, norms_f, seen_f = run(False)
    deferred, norms_d, seen_d = run(True)
    assert set(seen_f) == {False} and set(seen_d) == {True}
    assert_bitwise_equal(folded, deferred)
    assert_bitwise_equal(norms_f, norms_d)
    if clip == 0.05:
        assert all(float(n) > clip for n in norms_d)  # the clip did act


def test_clipping_a_subset_of_parameters_with_deferred_gradients(monkeypatch):
    def run(defer):
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
        if not defer:
            _never_defer(monkeypatch)
        model, mp, opt = setup("bf16-true-kahan")
        head = [p for n, p in model.named_parameters() if n.startswith("blocks.0.fc")]
        stats = train(model, mp, opt, range(3), max_grad_norm=0.01, parameters=head)
        monkeypatch.undo()
        return snapshot(model, mp, opt), [s.grad_norm for s in stats]

    assert_bitwise_equal(run(False), run(True))


def test_deferral_with_a_loss_scaler_but_not_with_accumulation(monkeypatch):
    # a loss scaler checks the 16-bit gradients where they wait; accumulation makes fp32 ones
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
    for kwargs, deferred in (({"skip_nonfinite": True}, True), ({"accumulate": 2}, False)):
        model, mp, opt = setup("bf16-true-sr", **kwargs)
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append((mp.masters.in_buckets, mp.masters.deferred)))
        train(model, mp, opt, range(2))
        assert seen and set(seen) == {(True, deferred)}, kwargs
