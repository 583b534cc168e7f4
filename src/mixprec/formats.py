"""The one table of number formats: names <-> dtypes and their limits.

Everything else in mixprec asks this module for a format's range or resolution; no other module
hard-codes 65504 or 2**-24.

>>> get_format("f16").max
65504.0
>>> get_format("bfloat16").dtype
torch.bfloat16
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format and the limits that matter for training.

    Attributes:
        name: canonical short name (``f32``, ``bf16``, ``f16``, ``e4m3``, ...).
        dtype: the torch dtype.
        exponent_bits, mantissa_bits: the bit layout (sign bit not counted).
        max: largest finite value; anything larger overflows (to inf, or NaN for e4m3fn).
        tiny: smallest positive normal value.
        smallest_subnormal: smallest positive value at all; below half of it a value flushes to 0.
        eps: the gap between 1.0 and the next value (2**-mantissa_bits).
    """

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    max: float
    tiny: float
    smallest_subnormal: float
    eps: float

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bytes(self) -> int:
        return self.bits // 8

    @property
    def is_16bit(self) -> bool:
        return self.bits == 16

    @property
    def log2_range(self) -> tuple[float, float]:
        """(log2 of the smallest subnormal, log2 of max): the representable exponent span."""
        return (math.log2(self.smallest_subnormal), math.log2(self.max))

    def update_vanishes_below(self) -> float:
        """Relative size under which ``w + dw`` rounds back to ``w`` (round to nearest): eps / 2."""
        return self.eps / 2


def _make(name: str, dtype: torch.dtype, exponent_bits: int, mantissa_bits: int) -> FloatFormat:
    fi = torch.finfo(dtype)
    return FloatFormat(
        name=name,
        dtype=dtype,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=float(fi.max),
        tiny=float(fi.tiny),
        smallest_subnormal=float(fi.smallest_normal) * 2.0**-mantissa_bits,
        eps=float(fi.eps),
    )


_FORMATS: dict[str, FloatFormat] = {
    "f64": _make("f64", torch.float64, 11, 52),
    "f32": _make("f32", torch.float32, 8, 23),
    "bf16": _make("bf16", torch.bfloat16, 8, 7),
    "f16": _make("f16", torch.float16, 5, 10),
    "e4m3": _make("e4m3", torch.float8_e4m3fn, 4, 3),
    "e5m2": _make("e5m2", torch.float8_e5m2, 5, 2),
}

# Accepted spellings -> canonical name. jmp's names (half, full, float32, ...), torch's, and the
# fp-prefixed ones people type. "half" means float16 here, as in torch (jmp maps it to bf16 on TPU).
_ALIASES: dict[str, str] = {
    "f64": "f64", "float64": "f64", "fp64": "f64", "double": "f64",
    "f32": "f32", "float32": "f32", "fp32": "f32", "full": "f32", "float": "f32", "32": "f32",
    "bf16": "bf16", "bfloat16": "bf16",
    "f16": "f16", "float16": "f16", "fp16": "f16", "half": "f16", "16": "f16",
    "e4m3": "e4m3", "fp8_e4m3": "e4m3", "float8_e4m3fn": "e4m3",
    "e5m2": "e5m2", "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2",
}

_BY_DTYPE: dict[torch.dtype, FloatFormat] = {f.dtype: f for f in _FORMATS.values()}


def format_names() -> list[str]:
    """The canonical names, widest first."""
    return list(_FORMATS)


def accepted_names() -> list[str]:
    return sorted(_ALIASES)


def get_format(spec: str | torch.dtype | FloatFormat) -> FloatFormat:
    """Look up a format by name (any accepted spelling), torch dtype, or pass one through.

    Raises ValueError naming the input and the accepted names.
    """
    if isinstance(spec, FloatFormat):
        return spec
    if isinstance(spec, torch.dtype):
        fmt = _BY_DTYPE.get(spec)
        if fmt is None:
            raise ValueError(
                f"dtype {spec} is not a floating-point format mixprec knows; "
                f"expected one of {', '.join(str(d) for d in _BY_DTYPE)}"
            )
        return fmt
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key.startswith("torch."):
            key = key[len("torch."):]
        canonical = _ALIASES.get(key)
        if canonical is None:
            raise ValueError(
                f"Unknown number format {spec!r}; expected one of {', '.join(accepted_names())}"
            )
        return _FORMATS[canonical]
    raise TypeError(f"expected a format name, torch.dtype or FloatFormat, got {type(spec).__name__}")


def to_dtype(spec: str | torch.dtype | FloatFormat) -> torch.dtype:
    return get_format(spec).dtype


def short_name(dtype: torch.dtype) -> str:
    """The canonical short name of a dtype (``torch.bfloat16`` -> ``bf16``)."""
    return get_format(dtype).name


def is_floating_16bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)
