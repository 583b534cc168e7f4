"""The fp8 weight cast, cached across the micro-batches of one accumulation window (issue 28.7): once per
window instead of once per micro-batch, bit for bit the same run, and never stale."""

from __future__ import annotations

import pytest
import torch

from fp8_helpers import batch, build, fp8_linear, train
from mixprec.fp8 import fp8_layers, weight_cache
from mixprec.tasks.charlm import lm_loss


class _Counting:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = weight_cache.quantize

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(weight_cache, "quantize", counted)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_each_weight_is_cast_once_per_accumulation_window(monkeypatch, recipe):
    model, mp, opt = build(recipe, accumulate=4)
    n = len(fp8_layers(model))
    count = _Counting(monkeypatch)
    train(model, mp, opt, range(4))  # one window: four micro-batches, one optimizer step
    assert count.calls == n  # not 4 n
    assert all(weight_cache.ATTR not in vars(m) for _, m in fp8_layers(model))  # dropped at the step
    train(model, mp, opt, range(4, 6))  # the next window casts the new weights once more
    assert count.calls == 2 * n


@pytest.mark.parametrize("spec", [{}, {"granularity": "rowwise"}], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_a_run_with_the_cache_is_bitwise_the_run_without(recipe, spec):
    if recipe == "fp8-delayed" and spec:
        pytest.skip("rowwise is current scaling only")
    runs = []
    for cache in (True, False):
        model, mp, opt = build(recipe, accumulate=3, fp8={"cache_weight": cache, **spec})
        losses = train(model, mp, opt, range(9))
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_weight_changed_inside_the_window_is_cast_again():
    lin = fp8_linear(32, 16)
    x = torch.randn(8, 32)
    first = lin(x)
    assert weight_cache.ATTR in vars(lin) and torch.equal(lin(x), first)  # cached, the same bits
    with torch.no_grad():
        lin.weight.mul_(3.0)  # an in-place change bumps the version
    fresh = fp8_linear(32, 16, cache_weight=False)
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(lin(x), fresh(x)) and not torch.equal(lin(x), first)
    lin.load_state_dict({k: v * 0.5 for k, v in lin.state_dict().items()})  # a load is a change too
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(lin(x), fresh(x))
    lin.weight = torch.nn.Parameter(torch.randn(16, 32))  # a replaced weight: another storage
    fresh.weight = torch.nn.Parameter(lin.weight.detach().clone())
    assert torch.equal(lin(x), fresh(x))


def test_delayed_scaling_casts_again_when_its_scales_change():
    lin = fp8_linear(32, 16, scaling="delayed", history=4)
    x = torch.randn(8, 32)
    lin(x).float().sum().backward()
    before = lin(x)
    with torch.no_grad():
        lin.fp8_scale[1] *= 0.25  # the weight's scale (as an update or a loaded state changes it)
    fresh = fp8_linear(32, 16, scaling="delayed", history=4, cache_weight=False)
    fresh.load_state_dict(lin.state_dict())
    fresh.fp8_scale.copy_(lin.fp8_scale)
    assert torch.equal(lin(x), fresh(x)) and not torch.equal(lin(x), before)


def test_an_eval_loop_casts_every_time_and_copies_leave_the_cast_behind():
    import copy

    model, mp, _ = build("fp8-current")
    x, y = batch(0)
    with mp.autocast():
        lm_loss(model(x), y)  # a training forward keeps its cast
    held = {n: vars(m)[weight_cache.ATTR] for n, m in fp8_layers(model)}
    model.eval()
    with torch.no_grad(), mp.autocast():
        a = lm_loss(model(x), y)
        b = lm_loss(model(x), y)
    # no_grad forwards neither keep nor replace a cast (weights swapped in through .data are not seen)
    assert torch.equal(a, b) and all(vars(m)[weight_cache.ATTR] is held[n] for n, m in fp8_layers(model))
    twin = copy.deepcopy(model)
    assert all(weight_cache.ATTR not in vars(m) for _, m in fp8_layers(twin))
