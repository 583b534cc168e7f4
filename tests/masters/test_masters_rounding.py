"""Rounding primitives against float64 references: stochastic rounding, Kahan addition, remainders."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.formats import get_format
from mixprec.masters.rounding import join_fp32, kahan_add_, nearest_bf16, split_fp32, stochastic_round_bf16

BF16 = get_format("bf16")


def _neighbours(x_32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values below and above |x| (same sign), in float64, from the bit pattern."""
    bits = x_32.view(torch.int32)
    low = (bits & -65536).view(torch.float32).double()
    high = ((bits & -65536) + 65536).view(torch.float32).double()
    return low, high


def _values_between_bf16_neighbours(n: int, seed: int) -> torch.Tensor:
    """fp32 values over 40 binades, both signs, plus bf16 subnormals; none exactly on a bf16 value."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-20, 20, generator=g))
    mag[: n // 10] = torch.empty(n // 10, dtype=torch.float64).uniform_(0, BF16.tiny, generator=g)  # subnormals
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * mag).float()
    on_grid = (x.view(torch.int32) & 0xFFFF) == 0
    return x[~on_grid]


def test_stochastic_rounding_is_unbiased_against_fp64():
    # Each draw is one of two neighbours a gap apart, so its std is <= gap / 2 and the mean of N
    # draws has std <= gap / (2 sqrt N). Every value's mean must sit within 5 of those stds of x.
    x = _values_between_bf16_neighbours(2000, seed=0)
    n = 4096
    g = torch.Generator().manual_seed(1)
    draws = stochastic_round_bf16(x.repeat(n, 1), g).double()  # (n, M)
    low, high = _neighbours(x)
    gap = high - low
    sigma = gap / (2 * math.sqrt(n))
    z = ((draws.mean(0) - x.double()) / sigma).abs()
    assert torch.isfinite(z).all()
    assert z.max() < 5.0, f"max |mean - x| = {z.max():.2f} sigma"
    # and the same bound does reject round-to-nearest, which is biased by up to half a gap
    z_nearest = ((x.to(torch.bfloat16).double() - x.double()) / sigma).abs()
    assert z_nearest.max() > 50.0


def test_stochastic_rounding_only_returns_the_two_neighbours_with_the_right_odds():
    x = torch.tensor([1.0 + 0.25 * 2**-7, -(3.0 + 0.75 * 2**-6)], dtype=torch.float32)  # 1/4 and 3/4 of a gap
    g = torch.Generator().manual_seed(2)
    draws = stochastic_round_bf16(x.repeat(20000, 1), g).double()
    low, high = _neighbours(x)
    assert ((draws == low) | (draws == high)).all()
    up = (draws == high).double().mean(0)
    # binomial std at n=20000 is <= 0.0035: 0.02 is more than 5 sigma
    assert abs(up[0].item() - 0.25) < 0.02 and abs(up[1].item() - 0.75) < 0.02


def test_stochastic_rounding_keeps_exact_values_and_specials():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, BF16.max, BF16.smallest_subnormal], dtype=torch.float32)
    specials = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(stochastic_round_bf16(exact, g), exact.to(torch.bfloat16))
    out = stochastic_round_bf16(specials, g)
    assert out[0] == math.inf and out[1] == -math.inf and torch.isnan(out[2])


def test_stochastic_rounding_repeats_with_the_same_generator_state():
    x = _values_between_bf16_neighbours(1000, seed=4)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    a = stochastic_round_bf16(x, g)
    g.set_state(state)
    assert torch.equal(stochastic_round_bf16(x, g), a)
    assert not torch.equal(stochastic_round_bf16(x, g), a)  # the state advanced


def _all_patterns_sample(seed: int) -> torch.Tensor:
    """Every bf16 high half (all 65536) with several low halves, plus 2M random fp32 bit patterns."""
    high = torch.arange(-32768, 32768, dtype=torch.int32) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    grid = (high[:, None] | lows[None, :]).flatten()
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(-(2**31), 2**31, (2_000_000,), dtype=torch.int64, generator=g).to(torch.int32)
    return torch.cat([grid, rand]).view(torch.float32)


def test_split_then_join_gives_the_fp32_back_bit_for_bit():
    x = _all_patterns_sample(seed=6)
    high, rem = split_fp32(x)
    assert high.dtype == torch.bfloat16 and rem.dtype == torch.int16
    back = join_fp32(high, rem)
    nan = torch.isnan(x)
    assert torch.equal(back[~nan].view(torch.int32), x[~nan].view(torch.int32))
    assert torch.isnan(back[nan]).all() and torch.isnan(high[nan]).all()


def test_split_high_half_is_round_to_nearest_with_ties_away_from_zero():
    x = _all_patterns_sample(seed=7)
    x = x[torch.isfinite(x)]
    high = nearest_bf16(x)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(high[~tie].view(torch.int16), x[~tie].to(torch.bfloat16).view(torch.int16))
    # at a tie both neighbours are equally near; split takes the one of larger magnitude
    _, away = _neighbours(x[tie])
    assert tie.sum() > 60000
    assert torch.equal(high[tie].double(), away)


def _accumulate(kind: str, start: torch.Tensor, update_32: torch.Tensor, steps: int) -> torch.Tensor:
    if kind == "fp32":
        x = start.clone()
        for _ in range(steps):
            x += update_32
        return x.double()
    x = start.to(torch.bfloat16)
    if kind == "nearest":
        for _ in range(steps):
            x = (x.float() + update_32).to(torch.bfloat16)
        return x.double()
    if kind == "kahan":
        comp = torch.zeros_like(x)
        for _ in range(steps):
            kahan_add_(x, comp, update_32)
        return x.double() - comp.double()  # the compensated running sum
    g = torch.Generator().manual_seed(8)
    for _ in range(steps):
        x = stochastic_round_bf16(x.float() + update_32, g)
    return x.double()


def test_long_sum_of_small_updates_stalls_in_bf16_but_kahan_and_sr_track_float64():
    # 64 weights near 1 (bf16 gap 2**-7), each receiving 4000 updates of 1e-4 to 2e-4: every
    # update is under half a gap (3.9e-3), the regime where "small updates vanish".
    steps = 4000
    start = torch.linspace(1.0, 1.5, 64, dtype=torch.float32).to(torch.bfloat16).float()
    update = torch.linspace(1e-4, 2e-4, 64, dtype=torch.float32)
    ref = start.double() + steps * update.double()  # float64: the exact sum
    travel = (ref - start.double()).abs()
    err = {k: ((_accumulate(k, start, update, steps) - ref).abs() / travel).max().item()
           for k in ("fp32", "nearest", "kahan", "sr")}
    assert err["nearest"] == pytest.approx(1.0)  # nothing moved at all: the whole sum vanished
    assert err["fp32"] < 1e-3
    # Kahan: a bf16 compensation keeps 8 bits of the dropped part, so each step can still lose
    # up to 2**-9 of it (<= 2**-9 * gap / 2, gap <= 2**-6 here): over 4000 steps at most 0.06,
    # i.e. 0.15 of the smallest travel (0.4). Measured: 0.033 (mean 0.013).
    assert err["kahan"] < 0.1
    # SR: a random walk; per step variance p(1-p) gap**2 with p = update/gap <= 0.026 gives a
    # std of about 0.05 after 4000 steps, i.e. <= 12% of the travel: 5 sigma is 0.6. Measured: 0.35.
    assert err["sr"] < 0.6


def test_kahan_addition_of_zero_leaves_weight_and_compensation_bitwise_unchanged():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1000, generator=g).to(torch.bfloat16)
    comp = (torch.randn(1000, generator=g) * 1e-3).to(torch.bfloat16)
    x0, c0 = x.clone(), comp.clone()
    kahan_add_(x, comp, torch.zeros(1000))
    assert torch.equal(x, x0) and torch.equal(comp, c0)
