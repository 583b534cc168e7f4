"""The casts and scales: bitwise against torch's own float8 casts, saturating, with the reference formulas."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_helpers import CAST_DB
from mixprec.fp8 import amax, current_scale, delayed_scale, dequantize, quantize, sqnr_db
from mixprec.fp8.casts import E4M3, E5M2, saturation_threshold, underflow_threshold

FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _every_fp8_value(fmt) -> torch.Tensor:
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    return vals[torch.isfinite(vals)]


def _probe_values(fmt) -> torch.Tensor:
    """Every fp8 value, the midpoints between neighbours (ties: round-half-even), just past them, the
    range's edges, overflow, and random values over the whole exponent range."""
    v = _every_fp8_value(fmt).unique()
    mid = (v[1:] + v[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-24, 20, (4096,), generator=g).float())
    edges = torch.tensor([fmt.max, saturation_threshold(fmt), math.nextafter(saturation_threshold(fmt), 0), 1e30,
                          underflow_threshold(fmt), math.nextafter(underflow_threshold(fmt), 1), 0.0, -0.0])
    x = torch.cat([v, mid, mid * (1 + 2**-20), mid * (1 - 2**-20), edges, -edges, rand])
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_is_bitwise_torchs_cast_of_the_clamped_value(fmt):
    x = _probe_values(fmt)
    for s in (1.0, 0.37, 1024.0):
        scale = torch.tensor(s)
        expected = torch.clamp(x * scale, -fmt.max, fmt.max).to(fmt.dtype)  # torch's own RNE conversion
        assert torch.equal(_bits(quantize(x, scale, fmt)), _bits(expected))


def test_e4m3_cast_equals_torchs_saturating_cast_without_our_clamp():
    # torch 2.13's CPU e4m3fn conversion saturates by itself (1000 -> 448): the clamp changes nothing there
    x = _probe_values(E4M3)
    assert torch.equal(_bits(quantize(x, torch.tensor(1.0), E4M3)), _bits(x.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_finite_overflow_saturates_never_inf_or_nan_and_nan_stays_nan(fmt):
    x = torch.tensor([1e5, -1e5, 1e6, -3e38, float("inf"), -float("inf"), float("nan")])  # all past both maxima
    q = quantize(x, torch.tensor(1.0), fmt).float()
    assert q[:6].tolist() == [fmt.max if v > 0 else -fmt.max for v in x[:6].tolist()]
    assert math.isnan(q[6])
    # e5m2's own conversion overflows to inf: the explicit clamp is what makes the paths agree
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fp8_value_survives_the_cast_unchanged(fmt):
    v = _every_fp8_value(fmt)
    assert torch.equal(dequantize(quantize(v, torch.tensor(1.0), fmt), torch.tensor(1.0)), v)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_and_underflow_thresholds_are_where_the_cast_changes_category(fmt):
    one = torch.tensor(1.0)
    sat = saturation_threshold(fmt)
    below = torch.nextafter(torch.tensor([sat]), torch.tensor([0.0]))
    # just below the threshold a value rounds to max (it would have without the clamp too)
    assert quantize(below, one, fmt).float().item() == fmt.max
    unf = underflow_threshold(fmt)
    assert quantize(torch.tensor([unf]), one, fmt).float().item() == 0.0  # the tie rounds to even: 0
    above = torch.nextafter(torch.tensor([unf]), torch.tensor([1.0]))  # the next fp32 value up
    assert quantize(above, one, fmt).float().item() == fmt.smallest_subnormal


def test_current_scale_is_torchaos_formula_float64_then_fp32():
    g = torch.Generator().manual_seed(1)
    amaxes = torch.rand(1000, generator=g) * torch.exp2(torch.randint(-30, 30, (1000,), generator=g).float())
    for fmt in (E4M3, E5M2):
        ours = torch.stack([current_scale(a, fmt) for a in amaxes])
        ref = (fmt.max / amaxes.double()).float()
        assert torch.equal(ours, ref)
    assert current_scale(torch.tensor(0.0), E4M3).item() == pytest.approx(448e12)  # the 1e-12 floor: finite
    s = current_scale(torch.tensor(3.0), E4M3, pow2=True)
    assert s.item() == 128.0  # 149.3 rounded down to a power of two


def test_delayed_scale_is_te_formula_and_keeps_the_previous_on_zero_or_nonfinite():
    prev = torch.full((5,), 7.0)
    a = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45])
    s = delayed_scale(a, prev, E4M3, margin=0)
    assert s[0].item() == 224.0
    assert s[1:4].tolist() == [7.0, 7.0, 7.0]
    assert s[4].item() == torch.finfo(torch.float32).max  # 448 / 1e-45 overflows fp32: TE clips to fp32 max
    assert delayed_scale(torch.tensor(2.0), prev[0], E5M2, margin=2).item() == 57344 / 2 / 4
    # the fp32 division, as TE computes it (not float64 like current scaling)
    a = torch.rand(1000, generator=torch.Generator().manual_seed(2)) + 0.1
    assert torch.equal(delayed_scale(a, torch.ones(1000), E4M3), torch.tensor(448.0) / a)


def test_amax_is_exact_per_tensor_and_per_row():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    assert amax(x).dtype == torch.float32 and amax(x).item() == x.float().abs().max().item()
    assert torch.equal(amax(x, -1), x.float().abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("seed", range(3))
def test_e4m3_cast_of_a_normal_tensor_keeps_25_db(seed):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))
    s = current_scale(amax(x), E4M3)
    # 3 mantissa bits: relative rounding error <= 2**-4, about 30 dB for values in the normal range
    assert sqnr_db(x, dequantize(quantize(x, s, E4M3), s)) >= CAST_DB
    s5 = current_scale(amax(x), E5M2)
    assert sqnr_db(x, dequantize(quantize(x, s5, E5M2), s5)) >= CAST_DB - 7  # 2 mantissa bits: ~6 dB less


def test_sqnr_is_nan_for_nan_and_inf_for_equal():
    x = torch.randn(10)
    assert sqnr_db(x, x) == float("inf")
    y = x.clone()
    y[3] = float("nan")
    assert math.isnan(sqnr_db(x, y))
    assert sqnr_db(x, torch.zeros(10)) == pytest.approx(0.0)


# ---------------------------------------------------------------- the exported casts' gradients (issue 28.3)

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_the_round_trip_passes_the_gradient_through_unchanged(fmt, dtype, rowwise):
    # the old casts sent the gradient through autograd's fp8 cast unscaled: ~1e-2 came back 100% zero
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=gen) * 1e-3).to(dtype).requires_grad_()
    g = torch.randn(32, 64, generator=gen) * 1e-2
    s = current_scale(amax(x, -1 if rowwise else None), fmt)
    y = dequantize(quantize(x, s, fmt), s)
    assert y.dtype == torch.float32 and y.requires_grad
    y.backward(g)
    assert x.grad.dtype == dtype and torch.equal(x.grad, g.to(dtype))  # as torchao's casts: the identity
    assert torch.equal(y.detach(), dequantize(quantize(x.detach(), s, fmt), s))  # forward untouched


def test_another_dequantization_scale_gets_the_chain_rules_factor():
    x = torch.randn(16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    s_q, s_d = torch.tensor(8.0), torch.tensor(2.0)
    dequantize(quantize(x, s_q, E4M3), s_d).backward(torch.ones(16))
    assert torch.equal(x.grad, torch.full((16,), 4.0))  # d(round(x * 8) / 2)/dx = 4 (straight through the rounding)


def test_bits_used_otherwise_than_through_dequantize_are_loud_not_silently_zero():
    x = torch.randn(8, 8).requires_grad_()
    q = quantize(x, torch.tensor(4.0), E4M3)
    assert q.requires_grad and q.dtype == E4M3.dtype
    with pytest.raises(ValueError, match="not quantize\\(\\)'s output itself \\(a view"):
        dequantize(q.t(), torch.tensor(4.0))
    with pytest.raises(RuntimeError, match="a gradient reached quantize\\(\\)'s fp8 output through an op other than"):
        (q.float() * 1e-2).sum().backward()
    with torch.no_grad():  # without autograd: plain bits, as before
        assert not quantize(x, torch.tensor(4.0), E4M3).requires_grad
    assert not quantize(x.detach(), torch.tensor(4.0), E4M3).requires_grad


@pytest.mark.parametrize("s", [0.0, -1.0, float("inf"), float("nan"), torch.tensor([1.0, 0.0])],
                         ids=["zero", "negative", "inf", "nan", "a-zero-row"])
def test_a_scale_that_is_not_finite_and_positive_is_refused(s):
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="quantize: the scale must be finite and positive everywhere"):
        quantize(x, s if isinstance(s, torch.Tensor) else torch.tensor(s), E4M3)
    with pytest.raises(ValueError, match="dequantize: the scale must be finite and positive"):
        dequantize(quantize(x, torch.tensor(1.0), E4M3), s)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_delayed_scale_never_reaches_zero_or_inf_within_the_allowed_margins(fmt):
    # issue 33: a margin of 200 made every scale 0. Within 0..14 the smallest scale, fp32's largest amax at
    # margin 14, is a positive subnormal; the largest, a subnormal amax at margin 0, is clamped to fp32's max
    from mixprec.fp8.options import max_margin

    f32 = torch.finfo(torch.float32)
    prev = torch.tensor(1.0)
    lo = delayed_scale(torch.tensor(f32.max), prev, fmt, margin=max_margin())
    hi = delayed_scale(torch.tensor(2.0**-149), prev, fmt, margin=0)
    assert 0 < float(lo) < f32.tiny and float(hi) == f32.max
