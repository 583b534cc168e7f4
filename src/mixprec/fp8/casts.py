"""The fp8 numerics: amax, scales, saturating casts, dequantization, and the error of a cast.

Suffixes: ``_hp`` a high-precision tensor (fp32 or bf16), ``_q`` its fp8 bits, ``s`` a scale (the
factor that maps ``x_hp`` into the fp8 range: ``x_q = fp8(x_hp * s)``, ``x_hp ~ x_q / s``).

Every cast clamps to the format's largest finite value before converting. torch 2.13's CPU cast to
e4m3fn already saturates (1000 -> 448, even inf -> 448) but its cast to e5m2 overflows to inf, and
other builds and hardware conversions differ (e4m3fn has no infinity: its overflow encoding is NaN).
Clamping first makes every path agree and a finite value never becomes NaN or inf; a NaN stays NaN.

Two scale formulas, one per scaling kind, each as its reference computes it:

- current scaling (torchao): ``s = fp8_max / max(amax, 1e-12)`` in float64, then rounded to fp32
  (torchao upcasts so that eager and compiled code agree; we do it to be bitwise torchao's);
- delayed scaling (Transformer Engine): ``s = (fp8_max * 2**-margin) / amax`` in fp32, where
  ``amax`` comes from a history (``mixprec.fp8.delayed``); an amax of zero or non-finite keeps the
  previous scale, and a scale that overflows fp32 becomes fp32's max.

>>> import torch
>>> x = torch.tensor([1000.0, -3.0, 0.01])
>>> s = current_scale(amax(x), E4M3)
>>> dequantize(quantize(x, s, E4M3), s)  # 3 mantissa bits; 0.01 lands on a subnormal
tensor([ 1.0000e+03, -3.0692e+00,  8.7193e-03])
>>> quantize(torch.tensor([1e6, float("inf")]), torch.tensor(1.0), E5M2).float()  # saturates, never inf
tensor([57344., 57344.])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.formats import FloatFormat, get_format

E4M3 = get_format("e4m3")
E5M2 = get_format("e5m2")
#: the three tensors each fp8 linear casts, in the order of every per-role tensor (scales, histories)
ROLES = ("input", "weight", "grad_output")
#: torchao's floor under amax, so that an all-zero tensor gets a finite scale
AMAX_EPS = 1e-12
_F32_MAX = torch.finfo(torch.float32).max


def role_formats(fmt: str) -> tuple[FloatFormat, FloatFormat, FloatFormat]:
    """The fp8 format of (input, weight, grad_output): ``"hybrid"`` is e4m3, e4m3, e5m2 (TE's
    Format.HYBRID), ``"e4m3"`` e4m3 for all three."""
    if fmt == "hybrid":
        return E4M3, E4M3, E5M2
    if fmt == "e4m3":
        return E4M3, E4M3, E4M3
    raise ValueError(f"fp8 format {fmt!r}; expected 'hybrid' or 'e4m3'")


def amax(x_hp: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |x|`` as fp32 (over ``dim``, kept as a size-1 dimension, for rowwise scales). Exact: an
    fp32 or bf16 magnitude is an fp32 value. An empty tensor's amax is 0 (an ``nn.Linear`` takes a
    batch of 0 tokens, an MoE expert that got none; torch's ``amax`` refuses to reduce over nothing)."""
    a = x_hp.detach().abs()
    if a.numel() == 0:
        return _empty_amax(a, dim)
    a = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return a.float()


def _empty_amax(a: torch.Tensor, dim: int | None) -> torch.Tensor:
    shape: list[int] = [] if dim is None else list(a.shape)
    if dim is not None:
        shape[dim] = 1
    return torch.zeros(shape, dtype=torch.float32, device=a.device)


def amax_fmax(x_hp: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as Transformer Engine's cast kernels compute it: a running ``fmaxf`` from 0, so a
    NaN element is skipped (an all-NaN tensor gives 0) while an infinity is kept. Delayed scaling
    records this one; current scaling keeps torchao's ``amax`` (a NaN makes the scale NaN)."""
    a = x_hp.detach().abs().float()
    if a.numel() == 0:  # (as ``amax``: nothing cast, 0, which leaves the history's slot as it was)
        return _empty_amax(a, None)
    return torch.where(torch.isnan(a), torch.zeros((), device=a.device), a).amax()


def current_scale(amax_: torch.Tensor, fmt: FloatFormat, pow2: bool = False) -> torch.Tensor:
    """torchao's current (dynamic) scale: ``fp8_max / max(amax, 1e-12)`` in float64, as fp32;
    with ``pow2``, rounded down to a power of two (the cast then scales exactly)."""
    # torchao's expression exactly (``number / tensor``: a reciprocal and a product, in float64,
    # then rounded to fp32), so that the scales and every cast are bitwise torchao's
    s = (fmt.max / torch.clamp(amax_.double(), min=AMAX_EPS)).float()
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def delayed_scale(amax_: torch.Tensor, previous: torch.Tensor, fmt: FloatFormat, margin: int = 0) -> torch.Tensor:
    """Transformer Engine's scale update: ``(fp8_max * 2**-margin) / amax`` in fp32 where amax is
    finite and positive, else the previous scale; an infinite result becomes fp32's max."""
    scaled_max = fmt.max * 2.0 ** (-margin)  # exact: a power of two times 448 or 57344
    # a true fp32 division, as TE's kernel does (``number / tensor`` is a reciprocal and a product in torch)
    s = torch.div(torch.full_like(amax_, scaled_max), amax_)
    s = torch.where(torch.isfinite(amax_) & (amax_ > 0), s, previous)
    return torch.where(torch.isinf(s), torch.full_like(s, _F32_MAX), s)


def quantize_raw(x_hp: torch.Tensor, s: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``fp8(clamp(x * s, -max, max))``: the product in fp32 (as torchao, so bf16 inputs round once),
    saturated before the cast so that no finite value overflows (see the module docstring). The
    fp8 layers' own cast: no check, no autograd (``quantize`` is the public, differentiable one)."""
    return torch.clamp(x_hp.float() * s, -fmt.max, fmt.max).to(fmt.dtype)


def dequantize_raw(x_q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x_q / s`` in fp32 (a division, as torchao's emulation does it, so the products agree bit for bit)."""
    return x_q.float() / s


_SOURCE = "_mixprec_fp8_source"  # on quantize()'s output: (the tensor it cast, its scale)


class _Quantize(torch.autograd.Function):
    """The bits require grad (so that a view or copy of them is seen by ``dequantize``), but their
    gradient never flows here: ``dequantize`` passes it straight to the source."""

    @staticmethod
    def forward(ctx: Any, x_hp: torch.Tensor, s: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
        return quantize_raw(x_hp, s, fmt)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        raise RuntimeError("a gradient reached quantize()'s fp8 output through an op other than dequantize(): autograd "
                           "would carry it in fp8 without a scale (gradients of ~1e-2 flush to zero). Dequantize the "
                           "fp8 tensor quantize() returned, then use the high-precision result")


class _PassThrough(torch.autograd.Function):
    """``dequantize(quantize(x, s), s')``: forward the round trip, backward ``g * s / s'`` to ``x``
    (``g`` itself when ``s'`` is ``s``), as torchao's casts pass gradients through."""

    @staticmethod
    def forward(ctx: Any, x_q: torch.Tensor, s_deq: torch.Tensor, x_hp: torch.Tensor, s_q: torch.Tensor) -> torch.Tensor:
        ctx.same = s_deq is s_q
        ctx.save_for_backward(s_deq, s_q)
        return dequantize_raw(x_q, s_deq)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        s_deq, s_q = ctx.saved_tensors
        return None, None, g if ctx.same else g * (s_q / s_deq), None


def _check_scale(s: Any, what: str) -> torch.Tensor:
    s = torch.as_tensor(s, dtype=torch.float32)
    if not s.is_floating_point() or not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"{what}: the scale must be finite and positive everywhere, got {s.tolist() if s.numel() <= 8 else s}"
                         " (a scale of 0 zeroes every value, an infinite one saturates them); compute it with "
                         "current_scale(amax(x), fmt) or delayed_scale(...)")
    return s


def quantize(x_hp: torch.Tensor, s: torch.Tensor | float, fmt: FloatFormat) -> torch.Tensor:
    """``fp8(clamp(x * s, -max, max))`` (``quantize_raw``), differentiable as torchao's casts are:
    ``dequantize`` of the result passes the gradient straight through to ``x_hp`` (the round trip's
    gradient is the identity, not a gradient cast to fp8). Checks that ``s`` is finite and positive
    (one host read)."""
    s = _check_scale(s, "quantize").to(x_hp.device)
    if not (torch.is_grad_enabled() and x_hp.requires_grad):
        return quantize_raw(x_hp, s, fmt)
    x_q = _Quantize.apply(x_hp, s, fmt)
    setattr(x_q, _SOURCE, (x_hp, s))
    return x_q


def dequantize(x_q: torch.Tensor, s: torch.Tensor | float) -> torch.Tensor:
    """``x_q / s`` in fp32 (``dequantize_raw``). Given ``quantize()``'s own output, the gradient
    passes through to the tensor it cast (times ``s_quantize / s``: exactly the incoming gradient
    when the scale is the same). Raises for fp8 bits that require grad but are not that output (a
    view or a copy: autograd would cast their gradient to fp8 unscaled); checks ``s`` as ``quantize``."""
    s = _check_scale(s, "dequantize").to(x_q.device)
    source = getattr(x_q, _SOURCE, None)
    if torch.is_grad_enabled() and source is not None:
        return _PassThrough.apply(x_q.detach(), s, *source)  # (the bits themselves take no gradient)
    if torch.is_grad_enabled() and x_q.requires_grad:
        raise ValueError("dequantize() got fp8 bits that require grad but are not quantize()'s output itself (a view, "
                         "a slice or a copy of it): their gradient would reach quantize() cast to fp8 without a scale. "
                         "Dequantize quantize()'s output, then reshape or slice the high-precision result")
    return dequantize_raw(x_q, s)


def saturation_threshold(fmt: FloatFormat) -> float:
    """The magnitude from which a scaled value is saturated by the clamp instead of rounded: the
    largest finite value plus half its ulp (exactly halfway rounds away from max)."""
    ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    return fmt.max + ulp / 2


def underflow_threshold(fmt: FloatFormat) -> float:
    """The magnitude at or below which a scaled value becomes 0 (half the smallest subnormal)."""
    return fmt.smallest_subnormal / 2


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(|ref| / |ref - approx|)`` in dB, in float64;
    inf when they are equal, NaN when either holds a NaN (a NaN never passes a gate)."""
    r, a = ref.detach().double(), approx.detach().double()
    noise = torch.linalg.vector_norm(r - a)
    signal = torch.linalg.vector_norm(r)
    if not bool(torch.isfinite(noise) & torch.isfinite(signal)):
        return float("nan")
    if float(noise) == 0.0:
        return float("inf")
    return float(20 * torch.log10(signal / noise))
