"""MXFP8: block scaling, a power-of-two (e8m0) scale for every 32 consecutive elements along the reduction axis.

The OCP Microscaling format as Blackwell's tensor cores take it and torchao's MXFP8 training emulates
it: each GEMM operand is cut into blocks of ``BLOCK`` (32) elements along the axis the GEMM reduces
over, and each block gets its own scale ``2**(e - 127)``, stored as one unsigned byte ``e`` (e8m0: an
exponent only; 255 is NaN). Two ways of choosing ``e`` from the block's amax:

- ``"rceil"`` (the default, torchao's ``MXFP8Linear`` and cuBLAS's): the smallest power of two at or
  above ``amax / fp8_max``, so the block's largest value lands at or below ``fp8_max`` and nothing
  saturates. Computed exactly from the bits (as the hardware's ``cvt.rp`` rounds); torchao's eager
  CPU code takes ``ceil(log2(x))`` in fp32, which rounds down for a ratio within ~2**-21 above a
  power of two and then saturates that block's largest value by less than one ulp (shown in
  tests/fp8/test_fp8_mx.py); everywhere else the two are bit for bit the same;
- ``"floor"`` (the OCP spec's): ``2**(floor(log2(amax)) - floor(log2(fp8_max)))``, torchao's FLOOR.

Elements are cast with the same saturating cast as per-tensor scaling. The three GEMMs of a linear
all take the form ``a @ b.T`` with both operands blocked along their last axis (the weight is
re-quantized along ``out`` for the input gradient, both gradient operands along the tokens for the
weight gradient), so every operand is quantized from its high-precision tensor: forward saves those
(as rowwise scaling does). The tokens are zero-padded to a multiple of 32 for the weight gradient
(zeros change no block's amax); ``in_features`` and ``out_features`` must be multiples of 32.

``gemm="emulate"``: dequantize (exact: a power of two times an fp8 value) and multiply in fp32.
``gemm="scaled_mm"``: ``torch._scaled_mm`` with ``float8_e8m0fnu`` scales in cuBLAS's swizzled layout
(``swizzle``), on CUDA sm100+ (Blackwell); unmeasured here (no such GPU was lent).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.fp8.casts import FloatFormat

BLOCK = 32
MODES = ("rceil", "floor")
_NAN_E = 255


def _pow2_from_biased(e: torch.Tensor) -> torch.Tensor:
    """``2**(e - 127)`` in fp32 for a biased e8m0 exponent (0 gives 2**-127, a subnormal; 255 NaN), built from bits."""
    ei = e.to(torch.int32)
    normal = torch.bitwise_left_shift(ei.clamp(1, 254), 23).view(torch.float32)
    out = torch.where(ei == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(ei == _NAN_E, torch.full_like(normal, math.nan), out)


def _exponent_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The biased exponent and the mantissa bits of positive fp32 values."""
    bits = x.view(torch.int32)
    return torch.bitwise_right_shift(bits, 23) & 0xFF, bits & 0x7FFFFF


def block_scales(amax: torch.Tensor, fmt: FloatFormat, mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """For each block's amax (fp32): ``(e, multiplier)``, the biased e8m0 exponent (uint8) and the fp32
    factor the block is multiplied by before its cast (``mode`` as the module docstring says)."""
    if mode == "rceil":
        descale = amax / fmt.max
        exp, mant = _exponent_bits(descale)
        # a normal ratio: its exponent, one up unless it is a power of two; a subnormal one (exponent
        # bits 0) is below 2**-126: the smallest scales (its block becomes 0 whichever is taken)
        ceil_log2 = torch.where(exp > 0, exp - 127 + (mant != 0).to(torch.int32), torch.full_like(exp, -127))
        e = (ceil_log2.clamp(-127, 127) + 127).to(torch.uint8)
        e = torch.where(torch.isinf(descale), torch.full_like(e, 254), e)
        e = torch.where(torch.isnan(descale), torch.full_like(e, _NAN_E), e)
        ei = e.to(torch.int32)
        recip = torch.bitwise_left_shift((254 - ei).clamp(1, 254), 23).view(torch.float32)  # 2**(127 - e)
        mult = torch.where(ei == 0, torch.ones_like(recip), recip)  # (as torchao: an all-but-zero block casts to 0)
        mult = torch.where(ei == 254, torch.full_like(recip, 2.0**-127), mult)
        return e, torch.where(ei == _NAN_E, descale, mult)
    if mode == "floor":
        exp, _ = _exponent_bits(amax)
        unbiased = (exp - 127 - math.floor(math.log2(fmt.max))).clamp(-127, 128)
        e = (unbiased + 127).to(torch.uint8)
        e = torch.where(torch.isnan(amax), torch.full_like(e, _NAN_E), e)
        scale = torch.bitwise_left_shift(e.to(torch.int32), 23).view(torch.float32).clamp(min=2.0**-126)
        return e, 1.0 / scale  # (exact: a power of two; the block is divided by ``scale``)
    raise ValueError(f"MX scale mode {mode!r}; expected one of {', '.join(MODES)}")


def mx_quantize(x_hp: torch.Tensor, fmt: FloatFormat, mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast ``x`` (last axis a multiple of 32) to MX: ``(q, e, multiplier)`` with ``q`` fp8 of ``x``'s
    shape and ``e`` (uint8), ``multiplier`` (fp32) one per block, shape ``(..., K // 32)``."""
    k = x_hp.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MX block scaling needs the reduction axis to be a multiple of {BLOCK}, got {k}")
    blocks = x_hp.float().reshape(*x_hp.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)  # (a NaN propagates: its block's scale is NaN, as torchao's)
    e, mult = block_scales(amax, fmt, mode)
    if mode == "floor":
        scaled = blocks / (1.0 / mult).unsqueeze(-1)
    else:
        scaled = blocks * mult.unsqueeze(-1)
    q = torch.clamp(scaled, -fmt.max, fmt.max).to(fmt.dtype)
    return q.reshape(x_hp.shape), e, mult


def mx_dequantize(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``q * 2**(e - 127)`` per block, in fp32 (exact)."""
    k = q.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], k // BLOCK, BLOCK)
    return (blocks * _pow2_from_biased(e).unsqueeze(-1)).reshape(q.shape)


def swizzle(e: torch.Tensor) -> torch.Tensor:
    """A ``(rows, cols)`` matrix of block scales in cuBLAS's layout for block-scaled GEMMs: padded to
    128 x 4 tiles; each tile's 128 rows, as 4 groups of 32, interleaved so that row ``32 i + j`` of
    the tile holds its 4 scales at ``[j, i, :]`` (a 32 x 16 tile), tiles row-major. Flattened."""
    rows, cols = e.shape
    r, c = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = e.new_zeros(r, c)
    padded[:rows, :cols] = e
    tiles = padded.view(r // 128, 128, c // 4, 4).permute(0, 2, 1, 3)  # (row tiles, col tiles, 128, 4)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()


def mx_mm(a_hp: torch.Tensor, fa: FloatFormat, b_hp: torch.Tensor, fb: FloatFormat, backend: str, mode: str,
          observe: Any = None) -> torch.Tensor:
    """``a @ b.T`` in fp32 from MX operands, both blocked along their last axis (the reduction).
    ``observe(which, hp, q, multiplier)`` sees each cast (``which`` 0 for ``a``, 1 for ``b``)."""
    a_q, a_e, a_m = mx_quantize(a_hp, fa, mode)
    b_q, b_e, b_m = mx_quantize(b_hp, fb, mode)
    if observe is not None:
        observe(0, a_hp, a_q, a_m)
        observe(1, b_hp, b_q, b_m)
    if backend == "emulate":
        return torch.mm(mx_dequantize(a_q, a_e), mx_dequantize(b_q, b_e).t())
    e8m0 = torch.float8_e8m0fnu
    return torch._scaled_mm(a_q, b_q.t(), swizzle(a_e).view(e8m0), swizzle(b_e).view(e8m0), out_dtype=torch.float32)


def pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, ...) with zero rows appended up to a multiple of 32 (the tokens of the weight gradient)."""
    extra = -t.shape[0] % BLOCK
    return t if not extra else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _observer(observers: tuple, role_a: int, fa: FloatFormat, role_b: int | None = None, fb: FloatFormat | None = None):
    """The ``observe`` of ``mx_mm`` for fp8 observers: each cast as blocks (the multiplier broadcast over them)."""
    if not observers:
        return None

    def observe(which: int, hp: torch.Tensor, q: torch.Tensor, mult: torch.Tensor) -> None:
        role, fmt = (role_a, fa) if which == 0 else (role_b, fb)
        if role is None:
            return
        shape = (*hp.shape[:-1], hp.shape[-1] // BLOCK, BLOCK)
        for obs in observers:
            obs.cast(role, hp.reshape(shape), q.reshape(shape), mult.unsqueeze(-1), fmt)

    return observe


class MxLinearFn(torch.autograd.Function):
    """``x @ w.T`` with MX operands, and both gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, cfg: Any, observers: tuple) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        fx, fw, _ = cfg.formats
        out = mx_mm(x2, fx, weight, fw, cfg.backend, cfg.mx_mode, _observer(observers, 0, fx, 1, fw))
        ctx.save_for_backward(x2, weight)
        ctx.cfg, ctx.observers, ctx.x_shape, ctx.x_dtype = cfg, observers, x.shape, x.dtype
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        with torch.autocast(grad.device.type, enabled=False):
            cfg = ctx.cfg
            fx, fw, fg = cfg.formats
            x2, weight = ctx.saved_tensors
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:  # reduced over out: the weight re-blocked along it
                grad_x = mx_mm(g2, fg, weight.t().contiguous(), fw, cfg.backend, cfg.mx_mode,
                               _observer(ctx.observers, 2, fg))
                grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:  # reduced over the tokens: both operands blocked along them
                gt, xt = pad_rows(g2).t().contiguous(), pad_rows(x2).t().contiguous()
                grad_w = mx_mm(gt, fg, xt, fx, cfg.backend, cfg.mx_mode)
            return grad_x, grad_w, None, None
