"""Delayed scaling: Transformer Engine's history and scale update, and what it does to a layer over steps."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_helpers import fp8_linear
from mixprec.fp8 import CastObserver
from mixprec.fp8 import delayed as D
from mixprec.fp8.casts import E4M3, E5M2

FMTS = (E4M3, E4M3, E5M2)


def _te_reference(history: list[list[float]], scale: list[float], algo: str, margin: int, fmts=FMTS):
    """TE's amax_and_scale_update (bulk kernel), written out per role as plain Python floats."""
    L = len(history)
    new_h = [row[:] for row in history]
    new_s = scale[:]
    for r in range(3):
        col = [history[i][r] for i in range(L)]
        last = col[0]
        if last == 0.0:
            amax = 0.0  # not rolled; the scale is kept
        else:
            rolled = [col[i + 1] if i < L - 1 else last for i in range(L)]
            amax = 0.0
            for a in rolled:
                amax = a if (a > amax or math.isnan(amax)) and not math.isnan(a) else amax  # fmaxf
            for i in range(L):
                new_h[i][r] = rolled[i] if i > 0 else 0.0
            if algo == "most_recent":
                amax = last
        if math.isfinite(amax) and amax > 0:
            s = float(torch.tensor(fmts[r].max * 2.0**-margin) / torch.tensor(amax))
            new_s[r] = torch.finfo(torch.float32).max if math.isinf(s) else s
    return new_h, new_s


@pytest.mark.parametrize("length", [1, 2, 5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_is_te_kernel_for_random_histories(length, algo):
    g = torch.Generator().manual_seed(length)
    for trial in range(20):
        h = torch.rand(length, 3, generator=g) * 10
        h[h < 1.5] = 0.0  # some roles unseen, some entries empty
        if trial % 5 == 0:
            h[0, 1] = float("inf")
        if trial % 7 == 0 and length > 1:
            h[length - 1, 2] = float("nan")
        s = torch.rand(3, generator=g) + 0.5
        ref_h, ref_s = _te_reference(h.tolist(), s.tolist(), algo, margin=1)
        hist, scale = h.clone(), s.clone()
        D.update([hist], [scale], FMTS, algo, 1)
        torch.testing.assert_close(hist, torch.tensor(ref_h), rtol=0, atol=0, equal_nan=True)  # exact, NaN = NaN
        torch.testing.assert_close(scale, torch.tensor(ref_s, dtype=torch.float32), rtol=0, atol=0)


def test_a_skipped_step_only_empties_the_current_slot():
    h = torch.tensor([[float("inf"), 5.0, float("nan")], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    s = torch.tensor([3.0, 4.0, 5.0])
    hist, scale = h.clone(), s.clone()
    D.update([hist], [scale], FMTS, "max", 0, skipped=torch.tensor(True))
    expected = h.clone()
    expected[0] = 0.0
    assert torch.equal(hist, expected) and torch.equal(scale, s)
    hist, scale = h.clone(), s.clone()
    D.update([hist], [scale], FMTS, "max", 0, skipped=torch.tensor(False))  # not skipped: the usual update
    assert hist[2, 0].item() == float("inf") and scale[0].item() == 3.0  # inf amax: the old scale is kept


def test_many_layers_update_together_as_each_alone():
    g = torch.Generator().manual_seed(3)
    hs = [torch.rand(4, 3, generator=g) for _ in range(5)]
    ss = [torch.rand(3, generator=g) + 1 for _ in range(5)]
    one_by_one = [(h.clone(), s.clone()) for h, s in zip(hs, ss)]
    for h, s in one_by_one:
        D.update([h], [s], FMTS, "max", 0)
    D.update(hs, ss, FMTS, "max", 0)
    for (h1, s1), h2, s2 in zip(one_by_one, hs, ss):
        assert torch.equal(h1, h2) and torch.equal(s1, s2)


def _step(lin, x, skipped=None):
    y = lin(x)
    y.float().square().mean().backward()
    D.update([lin.fp8_amax_history], [lin.fp8_scale], lin.fp8_config.formats, "max", 0, skipped)
    return y


def test_step_t_uses_the_scale_from_the_history_up_to_step_t_minus_1():
    lin = fp8_linear(32, 16, scaling="delayed", history=8)
    x0, x1 = torch.randn(8, 32), torch.randn(8, 32) * 3
    assert lin.fp8_scale.tolist() == [1.0, 1.0, 1.0]  # TE starts at scale 1
    _step(lin, x0)
    assert lin.fp8_scale[0].item() == pytest.approx(448 / x0.abs().max().item(), rel=1e-6)
    s_before = lin.fp8_scale.clone()
    obs = CastObserver(lin).attach()  # the forward of step 1 casts with step 0's scale
    _step(lin, x1)
    stats = {c.role: c for c in obs.read()}
    assert stats["input"].scale == pytest.approx(float(s_before[0]))
    assert lin.fp8_scale[0].item() == pytest.approx(448 / x1.abs().max().item(), rel=1e-6)  # max of both steps


def test_an_amax_spike_saturates_one_step_and_the_scale_recovers_as_the_history_turns_over():
    L = 4
    lin = fp8_linear(32, 16, scaling="delayed", history=L)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 32, generator=g) for _ in range(12)]
    spike = 5
    xs[spike] = xs[spike] * 100
    obs = CastObserver(lin, full=False).attach()
    saturated, scales = [], []
    for x in xs:
        _step(lin, x)
        saturated.append({c.role: c.saturated for c in obs.read()}["input"])
        scales.append(lin.fp8_scale[0].item())
    assert saturated[spike] > 0  # the spike is cast with the scale of the quiet steps before it
    assert all(n == 0 for i, n in enumerate(saturated) if i > spike)  # then the history has it
    # the spike stays in the window for L updates, then the scale returns to the quiet value
    assert all(scales[i] == scales[spike] for i in range(spike, spike + L))
    assert scales[spike + L] > 50 * scales[spike]


def test_current_scaling_never_saturates_even_on_a_spike():
    lin = fp8_linear(32, 16, scaling="current")
    obs = CastObserver(lin, full=False).attach()
    for k in (1.0, 1e4, 1e-6, 300.0):
        lin(torch.randn(16, 32) * k).float().square().mean().backward()
    assert all(c.saturated == 0 for c in obs.read())


def test_zero_tensors_keep_their_scales():
    lin = fp8_linear(32, 16, scaling="delayed", history=4)
    _step(lin, torch.randn(8, 32))
    before_s, before_h = lin.fp8_scale.clone(), lin.fp8_amax_history.clone()
    x = torch.zeros(8, 32, requires_grad=True)
    y = lin(x)
    (y * 0).sum().backward()  # zero input, zero output gradient: only the weight has an amax
    D.update([lin.fp8_amax_history], [lin.fp8_scale], lin.fp8_config.formats, "max", 0)
    assert lin.fp8_scale[0] == before_s[0] and lin.fp8_scale[2] == before_s[2]
    assert torch.equal(lin.fp8_amax_history[:, 0], before_h[:, 0])  # nothing rolled for the zero roles
    assert torch.isfinite(y).all()


def test_an_eval_forward_leaves_the_history_alone():
    lin = fp8_linear(32, 16, scaling="delayed", history=4)
    lin.eval()
    with torch.no_grad():
        lin(torch.randn(8, 32))
    assert (lin.fp8_amax_history == 0).all()
    lin.train()
    lin(torch.randn(8, 32))
    assert (lin.fp8_amax_history[0, :2] > 0).all()


# ---------------------------------------------------------------- where mixprec and TE meet, or differ on purpose (issue 28.4)

def _fmaxf_amax(values: list[float]) -> float:
    """TE's cast kernels: ``amax = fmaxf(fabsf(v), amax)`` from 0 (CUDA's fmaxf returns the other operand of a NaN)."""
    amax = 0.0
    for v in values:
        a = abs(v)
        amax = amax if math.isnan(a) else (a if math.isnan(amax) or a > amax else amax)
    return amax


@pytest.mark.parametrize("poison", ["one-nan", "nan-and-inf", "all-nan", "none"])
def test_a_delayed_layer_records_the_amax_te_records_nan_elements_skipped(poison):
    lin = fp8_linear(32, 16, scaling="delayed", history=4)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    if poison == "one-nan":
        x[3, 5] = float("nan")
    elif poison == "nan-and-inf":
        x[3, 5], x[0, 0] = float("nan"), float("-inf")
    elif poison == "all-nan":
        x[:] = float("nan")
    x.requires_grad_()
    lin(x).float().sum().backward()
    got = lin.fp8_amax_history[0].tolist()
    assert got[0] == _fmaxf_amax(x.detach().flatten().tolist())  # NaN is never recorded: what TE's fmaxf gives
    assert got[1] == _fmaxf_amax(lin.weight.detach().flatten().tolist())
    assert not any(math.isnan(v) for v in got)


def test_eval_forwards_leave_delayed_scaling_as_it_was_unlike_te():
    # TE's casts raise the current slot in every forward, eval included (its update waits for a forward with
    # grad enabled, so an eval pass's amax joins the next training step's). mixprec leaves the history alone in
    # model.eval() and under no_grad: evaluating between steps does not change training, bit for bit.
    def run(with_eval: bool):
        lin = fp8_linear(32, 16, scaling="delayed", history=4)
        g, g_eval = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
        outs = []
        for step in range(4):
            x = torch.randn(8, 32, generator=g)
            if with_eval:
                big = torch.randn(8, 32, generator=g_eval) * 1e3  # an eval batch 1000x larger than training's
                lin.eval()
                lin(big)
                lin.train()
                with torch.no_grad():
                    lin(big)
            outs.append(_step(lin, x).detach())
        return outs, lin.fp8_amax_history.clone(), lin.fp8_scale.clone()

    plain, evaluated = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], evaluated[0]))
    assert torch.equal(plain[1], evaluated[1]) and torch.equal(plain[2], evaluated[2])
