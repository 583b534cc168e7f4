"""Probes against references: real casts for underflow, real 16-bit adds for vanishing updates,
direct computation for activation ranges."""

import copy
import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import probe_activation_range, probe_grad_underflow, probe_update_vanishing
from mixprec.diagnostics._trace import hook_count
from mixprec.diagnostics.probes._common import rounding_thresholds
from mixprec.diagnostics.probes.gradients import GradStats, _Grid
from mixprec.diagnostics.probes.updates import vanished_fraction
from mixprec.formats import get_format
from mixprec.tasks import load_task

from . import zoo


def _wide_values(n=20000, seed=0):
    """Magnitudes spread log-uniformly over 2^-60 .. 2^20, both signs, plus exact zeros and
    exact powers of two (the rounding ties)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(n, generator=g, dtype=torch.float64) * 80 - 60
    x = (2.0**e * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).float()
    ties = torch.tensor([2.0**k for k in range(-60, 20)] + [0.0] * 50)
    return torch.cat([x, ties, -ties])


def _cast_reference(x, fmt, scale):
    """(zero, subnormal, overflow) fractions of the nonzero values by actually casting x * scale."""
    f = get_format(fmt)
    c = (x.double() * scale).to(f.dtype).double()  # one rounding, from the exact product
    nz = x != 0
    n = int(nz.sum())
    zero = int(((c == 0) & nz).sum())
    sub = int(((c != 0) & (c.abs() < f.tiny)).sum())
    over = int((~torch.isfinite(c)).sum())
    return zero / n, sub / n, over / n


@pytest.mark.parametrize("fmt", ["f16", "bf16", "e5m2"])
@pytest.mark.parametrize("k", [0, 10, 16, 24, 40])
def test_underflow_fractions_equal_counting_after_a_real_cast(fmt, k):
    x = _wide_values()
    stats = GradStats("x", "param", _Grid(["f16", "bf16", "e5m2"], [2.0**j for j in range(0, 41)]))
    stats.add(x)
    land = stats.landing(fmt, 2.0**k)
    assert (land.zero, land.subnormal, land.overflow) == _cast_reference(x, fmt, 2.0**k)


def test_e4m3_thresholds_match_its_format_table():
    f = get_format("e4m3")
    zero, normal, over = rounding_thresholds(f)
    assert zero == f.smallest_subnormal / 2 and normal == f.tiny - f.smallest_subnormal / 2
    assert over == f.max + 16  # 448's ulp is 32: 464 is the first value that does not round to 448
    c = torch.tensor([zero, zero * 1.01, f.tiny * 0.999, f.tiny], dtype=torch.float64).to(f.dtype).double()
    assert c[0] == 0 and 0 < c[1] < f.tiny and c[3] == f.tiny


def test_zero_norm_is_the_share_of_squared_norm_in_flushed_values():
    x = _wide_values()
    stats = GradStats("x", "param", _Grid(["f16"], [1.0]))
    stats.add(x)
    d = x.double()
    flushed = (d.abs() <= get_format("f16").smallest_subnormal / 2) & (d != 0)
    expect = float((d[flushed] ** 2).sum() / (d**2).sum())
    assert stats.landing("f16", 1.0).zero_norm == pytest.approx(expect, rel=1e-12)


def test_grad_probe_measures_parameters_and_module_outputs_and_restores_grads():
    task = zoo.make_deep_narrow()
    torch.manual_seed(0)
    model = task.build_model()
    x, y = task.get_batch(0)
    model.layers[3].weight.grad = torch.full_like(model.layers[3].weight, 7.0)  # pre-existing grad
    rep = probe_grad_underflow(model, lambda: task.loss_fn(model(x), y))
    assert torch.equal(model.layers[3].weight.grad, torch.full_like(model.layers[3].weight, 7.0))
    assert model.layers[0].weight.grad is None
    assert hook_count(model) == 0
    # reference: the same backward by hand
    model.zero_grad(set_to_none=True)
    task.loss_fn(model(x), y).backward()
    g = model.layers[0].weight.grad
    assert rep.get("layers.0.weight").absmax == pytest.approx(float(g.abs().max()), rel=1e-6)
    for k in (0, 16, 28):
        land = rep.landing("layers.0.weight", "f16", 2.0**k)
        assert (land.zero, land.subnormal, land.overflow) == _cast_reference(g, "f16", 2.0**k)
    # the planted fault: everything flushes without scaling, most still at 2^16, none at the recommendation
    assert rep.landing("layers.0.weight", "f16", 1.0).zero == 1.0
    assert rep.landing("layers.0.weight", "f16", 2.0**16).zero > 0.5
    assert rep.landing("layers.0.weight", "f16", rep.recommended_scale).zero == 0.0
    assert {a.name for a in rep.activations} >= {"layers.0", "layers.11", "(model)"}
    assert rep.worst("f16", 2.0**16, kind="module")[0][0].name == "layers.0"


def test_recommended_scale_is_the_largest_power_of_two_with_the_asked_headroom():
    task = zoo.make_healthy_mlp()
    torch.manual_seed(0)
    model = task.build_model()
    x, y = task.get_batch(0)
    for bits in (0, 1, 3):
        rep = probe_grad_underflow(model, lambda: task.loss_fn(model(x), y), headroom_bits=bits)
        s, top = rep.recommended_scale, rep.overall.absmax
        f16max = get_format("f16").max
        assert math.log2(s).is_integer()
        assert top * s * 2**bits <= f16max < top * (2 * s) * 2**bits


def test_grad_probe_measures_extra_scales_and_refuses_unmeasured_ones():
    model = nn.Linear(3, 1)
    rep = probe_grad_underflow(model, lambda: model(torch.ones(2, 3)).sum(), scales=[1000.0])
    rep.landing("weight", "f16", 1000.0)
    with pytest.raises(KeyError, match="was not measured"):
        rep.landing("weight", "f16", 3.0)
    with pytest.raises(TypeError, match="scalar loss"):
        probe_grad_underflow(model, lambda: model(torch.ones(2, 3)))


# ---------------------------------------------------------------- update vanishing


def test_update_vanishes_exactly_below_half_an_ulp():
    w = torch.ones(4)
    # bf16 ulp at 1.0 is 2^-7: below half of it (2^-8) the update is lost, above it is kept;
    # exactly half ties to even (1.0)
    dw = torch.tensor([2.0**-10, 2.0**-8, 2.0**-8 * 1.01, 2.0**-6])
    frac, n = vanished_fraction(w, dw, "bf16")
    assert n == 4 and frac == 0.5
    frac16, _ = vanished_fraction(w, dw, "f16")  # f16 keeps all four (ulp 2^-10, half 2^-11)
    assert frac16 == 0.0


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_vanished_fraction_agrees_with_a_real_16_bit_add(fmt):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50000, generator=g) * 0.1
    dw = torch.randn(50000, generator=g) * 10 ** (torch.rand(50000, generator=g) * 6 - 8)  # 1e-8 .. 1e-2
    frac, _ = vanished_fraction(w, dw, fmt)
    dtype = get_format(fmt).dtype
    w16 = w.to(dtype)
    real = (w16.clone().add_(dw.to(dtype)) == w16).double().mean().item()  # what pure 16-bit training does
    # they differ only where rounding dw itself to 16 bits changes the outcome (ties): rare
    assert frac == pytest.approx(real, abs=2e-3)
    assert 0.05 < frac < 0.95  # the data straddles the threshold, so the test can fail


def test_update_probe_finds_the_small_update_params_and_restores_training_bit_for_bit():
    task = zoo.make_deep_narrow()
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = task.get_batch(0)
    closure = lambda: task.loss_fn(model(x), y)  # noqa: E731
    closure().backward()
    opt.step()  # some optimizer state to preserve
    opt.zero_grad()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-4)
    twin_opt.load_state_dict(opt.state_dict())
    rep = probe_update_vanishing(model, opt, closure)
    # Adam moves each element by about lr = 1e-4; the weights are ~0.1: a relative step near 1e-3,
    # under bf16's half-ulp (2^-9) nearly always, under f16's (2^-12) about half the time
    assert rep.overall("bf16") > 0.8 > rep.overall("f16") > 0.2
    assert "layers.0.weight" in rep.needs_master("bf16")
    ref = copy.deepcopy(model)  # the reference: the same step, taken by hand
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ref_opt.load_state_dict(opt.state_dict())
    w0 = ref.layers[11].weight.detach().clone()
    task.loss_fn(ref(x), y).backward()
    ref_opt.step()
    dw = ref.layers[11].weight.detach().double() - w0.double()
    p = next(p for p in rep.params if p.name == "layers.11.weight")
    assert p.updated == int((dw != 0).sum())
    assert p.relative_update == float((dw.abs() / w0.double().abs()).median())
    for _ in range(2):  # training continues exactly as if the probe had never run
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            task.loss_fn(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_update_probe_rejects_an_optimizer_of_other_parameters():
    with pytest.raises(ValueError, match="holds none"):
        probe_update_vanishing(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), lambda: None)


# ---------------------------------------------------------------- activation range


def test_activation_probe_flags_attention_logits_past_fp16_max_with_the_true_value():
    task = zoo.make_attention_overflow()
    torch.manual_seed(0)
    model = task.build_model()
    x, _ = task.get_batch(0)
    with torch.no_grad():
        rep = probe_activation_range(model, lambda: model(x))
        h = model.embed(x)
        B, T, C = h.shape
        q, k, _ = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in model.attn.qkv(h).split(C, dim=2))
        expect = float((q @ k.transpose(-2, -1)).abs().max())
    top = rep.flagged()[0]
    assert (top.module, top.op, top.occurrence, top.status) == ("attn", "matmul", 0, "overflow")
    assert top.absmax == expect and top.absmax > get_format("f16").max
    assert top.where.startswith("zoo.py:")
    assert hook_count(model) == 0


def test_activation_probe_ignores_the_causal_mask_minus_inf_and_flags_by_headroom():
    task = load_task(None, batch_size=2, seq_len=16)
    torch.manual_seed(0)
    model = task.build_model()
    x, _ = task.get_batch(0)
    with torch.no_grad():
        rep = probe_activation_range(model, lambda: model(x))
        strict = probe_activation_range(model, lambda: model(x), headroom_bits=15)
    masked = [e for e in rep.entries if e.op == "masked_fill"]
    assert masked and all(math.isfinite(e.absmax) for e in masked)
    assert rep.flagged() == []
    largest = max(e.absmax for e in rep.entries)
    assert [e.absmax for e in strict.flagged()][0] == largest  # 2^15 headroom: flags the big ones
    assert all(get_format("f16").max / e.absmax < 2**15 for e in strict.flagged())


def test_at_risk_under_a_recipe_leaves_out_what_the_recipe_keeps_in_fp32():
    task = load_task(None, batch_size=2, seq_len=16)
    torch.manual_seed(0)
    m32 = task.build_model()
    torch.manual_seed(0)
    m16 = task.build_model()
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu")
    mp.prepare(m16)  # LayerNorms become fp32 islands
    x, _ = task.get_batch(0)
    with torch.no_grad():
        full = probe_activation_range(m32, lambda: m32(x))
        with mp.autocast():
            recipe = probe_activation_range(m16, lambda: m16(x))
    risk = full.at_risk_under(recipe)
    ops = {(e.module, e.op) for e in risk.entries}
    assert ("blocks.0.ln1", "layer_norm") in {(e.module, e.op) for e in full.entries}
    assert ("blocks.0.ln1", "layer_norm") not in ops  # computed in fp32 under the recipe
    assert ("blocks.0.qkv", "linear") in ops and ("blocks.0", "matmul") in ops


def test_probes_say_which_argument_is_wrong():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="takes the model \\(an nn.Module\\) first, got str"):
        probe_grad_underflow("m", lambda: model(torch.ones(1, 2)).sum())
    with pytest.raises(TypeError, match="takes a closure that runs the forward"):
        probe_activation_range(model, model(torch.ones(1, 2)))
    with pytest.raises(TypeError, match="takes the optimizer .* second, got Linear"):
        probe_update_vanishing(model, model, lambda: model(torch.ones(1, 2)).sum())
    assert hook_count(model) == 0 and model.weight.grad is None
