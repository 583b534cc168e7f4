"""Rounding primitives of the master-weight strategies, as pure tensor functions.

- ``stochastic_round_bf16``: fp32 -> bf16, rounding up with probability equal to the distance
  to the value below, so ``E[round(x)] == x`` exactly (no bias, however small the update). Its
  random bits come from ``random_bits16``: a counter-based hash of the element's index under a
  key drawn from a ``torch.Generator`` (two 32-bit words per call), so they are the same on every
  device and inside a compiled kernel (``mixprec.masters.kernels``), and a saved generator state
  repeats them.
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
_M32 = 0xFFFFFFFF
_EXP = 0x7F800000  # fp32's exponent bits: all set for inf and NaN
_ABS = 0x7FFFFFFF
_QNAN16 = 0x7FC0  # bf16's quiet NaN (what torch's scalar conversion gives)
# The two multipliers of a well-mixing 32-bit integer hash (C. Wellons' hash-prospector, the
# two-multiply search): both below 2**31, so a product of a 32-bit value and one stays below
# 2**63 and int64 arithmetic never overflows (no reliance on wrap-around, eager or compiled).
_K1, _K2 = 0x21F0AAAD, 0x735A2D97


def _bits(x_32: torch.Tensor) -> torch.Tensor:
    if x_32.dtype != torch.float32:
        raise TypeError(f"expected an fp32 tensor, got {x_32.dtype}")
    return x_32.contiguous().view(torch.int32)


def draw_key(generator: torch.Generator | None, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Two 32-bit words from ``generator`` (an int64 tensor on ``device``, or drawn into ``out``):
    the key of one stream of random bits. The generator advances by one draw of two words,
    whatever the stream's length."""
    if out is None:
        out = torch.empty(2, dtype=torch.int64, device=device)
    return out.random_(0, 1 << 32, generator=generator)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """The hash's rounds on int64 values in [0, 2**32), in place (one temporary at a time)."""
    x.bitwise_xor_(x >> 16).mul_(_K1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_K2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def random_bits16(numel: int, key: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Random values in [0, 2**16) for the elements ``start .. start + numel`` of a stream, int32.

    Element ``e`` gets half of a 32-bit hash of its pair ``e // 2`` keyed by ``key``'s two words
    (``draw_key``; ``((pair ^ k0) + k1) mod 2**32`` is hashed): the high 16 bits when ``e`` is even,
    the low 16 when odd. A value depends on its index in the stream only, so cutting the stream into
    pieces (buckets) changes nothing. (Pair indices wrap at 2**32: past 8 billion elements the
    stream repeats.)"""
    first = start // 2
    x = torch.arange(first, (start + numel + 1) // 2, dtype=torch.int64, device=key.device)
    x = _mix32_(x.bitwise_and_(_M32).bitwise_xor_(key[0]).add_(key[1]).bitwise_and_(_M32))
    out = torch.empty(2 * x.numel(), dtype=torch.int32, device=key.device)
    torch.bitwise_right_shift(x, 16, out=out[0::2])  # (written as int32: the values are below 2**16)
    torch.bitwise_and(x, _LOW, out=out[1::2])
    return out[start - 2 * first:][:numel]


def random_bits16_at(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``random_bits16`` for the stream indices ``index`` (int64), element by element: the form a
    fused kernel computes (``mixprec.masters.kernels``)."""
    x = _mix32(((((index >> 1) & _M32) ^ key[0]) + key[1]) & _M32)
    return torch.where((index & 1) == 1, x & _LOW, x >> 16).to(torch.int32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _K1) & _M32
    x = x ^ (x >> 15)
    x = (x * _K2) & _M32
    return x ^ (x >> 15)


def round_bf16_with_bits(x_32: torch.Tensor, random_16: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding with given random values in [0, 2**16), one per element (an int32
    tensor this overwrites): adding them to the 16 bits bf16 drops carries into the kept bits with
    probability ``dropped / 2**16``.

    All in integers (the kept half of the sum is the bf16 pattern; an arithmetic shift keeps the
    sign): no float conversion, whose NaN bits differ between CPUs' kernels. An infinity passes as
    it is; a NaN (whose payload may sit only in the dropped bits, and would carry into an infinity)
    becomes bf16's quiet NaN 0x7FC0."""
    bits = _bits(x_32)
    out = random_16.view(bits.shape).add_(bits).bitwise_right_shift_(16)  # (in place: few temporaries)
    torch.where((bits & _EXP) == _EXP, bits >> 16, out, out=out)
    out = out.to(torch.int16)
    return out.masked_fill_((bits & _ABS) > _EXP, _QNAN16).view(torch.bfloat16)


def stochastic_round_bf16(x_32: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 to bf16 stochastically: up (in magnitude) with probability ``dropped / 2**16``.

    The two candidates are the bf16 values either side of ``x``; the expected result is ``x``
    exactly, for normals and subnormals alike. inf and NaN pass through as they are.
    ``generator`` (on ``x``'s device) makes the draws reproducible; its state is what a
    checkpoint must carry for resume to be bitwise. (``mixprec.masters.kernels`` runs the same
    arithmetic as one fused kernel: the same bits.)
    """
    _bits(x_32)
    return round_bf16_with_bits(x_32, random_bits16(x_32.numel(), draw_key(generator, x_32.device)))


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
    high_16 = high.to(torch.int16)
    del high
    rem_16 = rem.to(torch.int16)
    del rem
    # The NaNs with the largest payloads carry out of the mantissa when rounded: keep them NaN
    # (bf16's quiet NaN; tested on the bit pattern, in integers like the rest).
    return high_16.masked_fill_((bits & _ABS) > _EXP, _QNAN16).view(torch.bfloat16), rem_16


def join_fp32(high_16: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> the fp32 that ``split_fp32`` split."""
    if high_16.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise TypeError(f"join_fp32 expects (bfloat16, int16), got ({high_16.dtype}, {rem.dtype})")
    high = high_16.contiguous().view(torch.int16).to(torch.int32)
    bits = (high << 16) + rem.to(torch.int32)
    # Mirror of split: a NaN stored as a NaN bf16 comes back NaN (its own bits) whatever the remainder says.
    return torch.where((high & 0x7FFF) > 0x7F80, high << 16, bits).view(torch.float32)


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
