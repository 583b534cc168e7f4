"""Rounding primitives of the master-weight strategies, as pure tensor functions.

- ``stochastic_round_bf16``: fp32 -> bf16, rounding up with probability equal to the distance
  to the value below, so ``E[round(x)] == x`` exactly (no bias, however small the update).
- ``kahan_add_``: add an fp32 update to a 16-bit tensor with a 16-bit compensation buffer that
  carries what rounding dropped into the next update.
- ``split_fp32`` / ``join_fp32``: an fp32 tensor as a bf16 tensor (the fp32 rounded to nearest)
  plus an int16 remainder; joining them gives the fp32 back bit for bit (Megatron's trick: an
  exact fp32 master for 2 extra bytes per parameter).

Suffix legend: ``_32`` fp32, ``_16`` a 16-bit float, ``bits`` an int32 view of fp32 bit patterns.

The bit tricks rely on bf16 being the upper half of fp32: same sign, same 8 exponent bits, the
top 7 of fp32's 23 mantissa bits. Integer arithmetic on the raw pattern moves the magnitude
(the sign is the top bit and is never carried into), so it rounds negatives symmetrically.
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF  # the 16 mantissa bits bf16 drops
_HIGH_MASK = -65536  # 0xFFFF0000 as an int32
_HALF = 0x8000  # half of a bf16 ulp, in the dropped bits


def _bits(x_32: torch.Tensor) -> torch.Tensor:
    if x_32.dtype != torch.float32:
        raise TypeError(f"expected an fp32 tensor, got {x_32.dtype}")
    return x_32.contiguous().view(torch.int32)


def stochastic_round_bf16(x_32: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 to bf16 stochastically: up (in magnitude) with probability ``dropped / 2**16``.

    The two candidates are the bf16 values either side of ``x``; the expected result is ``x``
    exactly, for normals and subnormals alike. inf and NaN pass through as they are.
    ``generator`` (on ``x``'s device) makes the draws reproducible; its state is what a
    checkpoint must carry for resume to be bitwise.
    """
    bits = _bits(x_32)
    # in place on the random bits: one int32 buffer, a mask and the result (7 bytes per element)
    work = torch.randint(0, _LOW + 1, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded_32 = work.add_(bits).bitwise_and_(_HIGH_MASK).view(torch.float32)  # low bits zero: the cast is exact
    # A NaN whose payload sits only in the dropped bits would come out as inf: keep specials as they are.
    torch.where(torch.isfinite(x_32), rounded_32, x_32, out=rounded_32)
    return rounded_32.to(torch.bfloat16)


def nearest_bf16(x_32: torch.Tensor) -> torch.Tensor:
    """The bf16 half of ``split_fp32``: round to nearest, ties away from zero.

    Differs from ``x.to(torch.bfloat16)`` (ties to even) only at exact ties, where the dropped
    bits are exactly ``0x8000``. It must round ties one fixed way for the remainder to fit in 16
    bits: an even bf16 value has 2**16 + 1 fp32 values that round to it under ties-to-even.
    """
    return split_fp32(x_32)[0]


def split_fp32(x_32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest with ties away from zero, int16 remainder).

    ``join_fp32(*split_fp32(x))`` is ``x`` bit for bit for every non-NaN value (infinities and
    subnormals included); a NaN comes back NaN.
    """
    bits = _bits(x_32)
    high = (bits + _HALF) >> 16  # arithmetic shift: sign-extends, so negatives stay in int16 range
    rem = bits - (high << 16)  # in [-2**15, 2**15): what the rounded value misses, in fp32 ulps
    high_16 = high.to(torch.int16).view(torch.bfloat16)
    # The NaNs with the largest payloads carry out of the mantissa when rounded: keep them NaN.
    high_16 = torch.where(torch.isnan(x_32), x_32.to(torch.bfloat16), high_16)
    return high_16, rem.to(torch.int16)


def join_fp32(high_16: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> the fp32 that ``split_fp32`` split."""
    if high_16.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise TypeError(f"join_fp32 expects (bfloat16, int16), got ({high_16.dtype}, {rem.dtype})")
    bits = (high_16.contiguous().view(torch.int16).to(torch.int32) << 16) + rem.to(torch.int32)
    joined = bits.view(torch.float32)
    # Mirror of split: a NaN stored as a NaN bf16 comes back NaN whatever the remainder says.
    return torch.where(torch.isnan(high_16), high_16.to(torch.float32), joined)


def kahan_add_(param_16: torch.Tensor, comp_16: torch.Tensor, update_32: torch.Tensor) -> None:
    """``param_16 += update_32`` with Kahan compensation held in ``comp_16`` (both in place).

    The arithmetic runs in fp32; only the sum and its compensation are stored in 16 bits. Where
    the update is exactly zero nothing changes (a skipped step, a frozen element), so the pair
    is left bitwise as it was.
    """
    # (written to keep temporaries few, results in place or in 16-bit outputs; and with the
    # 16-bit operands made fp32 first: a mixed-dtype CPU kernel takes a slow, unvectorised path,
    # 3-5x slower than a conversion and an fp32 op. The values are the same bit for bit:
    # -c + u is u - c in IEEE arithmetic, and x.bool() is x != 0, NaN included.)
    p_32 = param_16.float()
    y_32 = comp_16.float().neg_().add_(update_32)  # the update plus what earlier roundings dropped
    t_16 = torch.add(p_32, y_32, out=torch.empty_like(param_16))  # the sum, rounded to 16 bits
    # t - p is exact in fp32 (both are 16-bit values close together): minus y, it is what was dropped, negated
    c_16 = t_16.float().sub_(p_32).sub_(y_32).to(comp_16.dtype)
    del p_32, y_32
    moved = update_32.bool()
    torch.where(moved, t_16, param_16, out=param_16)
    torch.where(moved, c_16, comp_16, out=comp_16)
