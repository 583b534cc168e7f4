"""The fp8 numerics in JAX: amax, scales, saturating casts, dequantization. The torch side's
(``mixprec.fp8.casts``), operation for operation, so that the same input gives the same fp8 bits
and the same scales in both frameworks (tests/jax/test_jax_fp8_torch.py checks it bitwise).

Suffixes as there: ``_hp`` high precision, ``_q`` fp8 bits, ``s`` the scale (``x_q = fp8(x_hp * s)``,
``x_hp ~ x_q / s``).

- ``quantize``: ``fp8(clamp(x * s, -max, max))``, the product in f32. The clamp makes the cast
  saturate on every backend (e4m3fn has no infinity: its overflow encoding is NaN; e5m2 overflows
  to inf); a NaN stays NaN. XLA's conversion rounds to nearest even, bitwise torch's (tested over
  every fp8 value and every midpoint).
- current scaling (torchao): ``s = fp8_max / max(amax, 1e-12)``. torchao divides in float64 and
  rounds to f32; here the division is in f32, which gives the same f32 for every amax: a correctly
  rounded quotient rounded again to f32 equals the correctly rounded f32 quotient when the wide
  format has at least 2p + 2 bits (53 >= 2 * 24 + 2). Below the floor the scale is a constant
  computed on the host the torch way.
- delayed scaling (Transformer Engine): ``s = (fp8_max * 2**-margin) / amax`` in f32 where amax is
  finite and positive, else the previous scale; a scale that overflows f32 becomes f32's max.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: the three tensors each fp8 dot casts, in the order of every per-role array (scales, histories)
ROLES = ("input", "weight", "grad_output")
#: torchao's floor under amax, so that an all-zero tensor gets a finite scale
AMAX_EPS = 1e-12
_F32_MAX = float(np.finfo(np.float32).max)
E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMAT_NAMES = {jnp.dtype(E4M3): "e4m3", jnp.dtype(E5M2): "e5m2"}


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def role_formats(fmt: str) -> tuple[Any, Any, Any]:
    """The fp8 dtypes of (input, weight, grad_output): ``"hybrid"`` is e4m3, e4m3, e5m2 (TE's
    Format.HYBRID), ``"e4m3"`` e4m3 for all three."""
    if fmt == "hybrid":
        return E4M3, E4M3, E5M2
    if fmt == "e4m3":
        return E4M3, E4M3, E4M3
    raise ValueError(f"fp8 format {fmt!r}; expected 'hybrid' or 'e4m3'")


def amax(x_hp: jax.Array) -> jax.Array:
    """``max |x|`` as f32 (exact: an f32, bf16 or f16 magnitude is an f32 value)."""
    return jnp.max(jnp.abs(x_hp)).astype(jnp.float32)


def _eps_threshold_and_scale(dtype: Any) -> tuple[np.float32, np.float32]:
    # amax < 1e-12 (exactly, as torch compares the f32 amax widened to float64) iff amax < t, t the
    # smallest f32 >= 1e-12; the scale there is torch's float64 quotient by 1e-12, rounded to f32
    t = np.float32(AMAX_EPS)
    if float(t) < AMAX_EPS:
        t = np.nextafter(t, np.float32(1.0))
    return t, np.float32(fp8_max(dtype) * (1.0 / AMAX_EPS))  # torch's number / tensor: a reciprocal, a product


def current_scale(amax_: jax.Array, dtype: Any) -> jax.Array:
    """torchao's current (dynamic) scale ``fp8_max / max(amax, 1e-12)`` as f32 (see the module docstring)."""
    t, floor_scale = _eps_threshold_and_scale(dtype)
    a = jnp.asarray(amax_, jnp.float32)
    return jnp.where(a < t, floor_scale, jnp.float32(fp8_max(dtype)) / a)  # NaN amax: NaN, as torch's clamp keeps it


def delayed_scale(amax_: jax.Array, previous: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
    """Transformer Engine's scale update: ``(fp8_max * 2**-margin) / amax`` in f32 where amax is finite
    and positive, else ``previous``; an infinite result becomes f32's max."""
    scaled_max = jnp.float32(fp8_max(dtype) * 2.0 ** (-margin))  # exact: a power of two times 448 or 57344
    a = jnp.asarray(amax_, jnp.float32)
    s = jnp.where(jnp.isfinite(a) & (a > 0), scaled_max / a, previous)
    return jnp.where(jnp.isinf(s), jnp.float32(_F32_MAX), s)


def quantize(x_hp: jax.Array, s: jax.Array, dtype: Any) -> jax.Array:
    """``fp8(clamp(x * s, -max, max))``: the product in f32, saturated before the cast."""
    m = jnp.float32(fp8_max(dtype))
    return jnp.clip(x_hp.astype(jnp.float32) * s, -m, m).astype(dtype)


def dequantize(x_q: jax.Array, s: jax.Array) -> jax.Array:
    """``x_q / s`` in f32."""
    return x_q.astype(jnp.float32) / s


def max_margin() -> int:
    """The largest margin that keeps ``fp8_max * 2**-margin`` at or above e4m3's smallest normal (14)."""
    info = jnp.finfo(E4M3)
    return int(np.floor(np.log2(float(info.max) / float(info.smallest_normal))))


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """What an fp8 dot does, as constants (hashable: it is static under ``jit``).

    Attributes:
        formats: the fp8 dtypes of (input, weight, grad_output).
        scaling: ``"current"`` (from the tensor being cast), ``"delayed"`` (from an amax history up to
            the step before: the dot takes an ``Fp8Meta``) or ``"none"`` (scale 1: the unsafe baseline).
        amax_history_len, amax_compute_algo, margin: delayed scaling's, as Transformer Engine's.
    """

    formats: tuple[Any, Any, Any] = (E4M3, E4M3, E5M2)
    scaling: str = "current"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in ("current", "delayed", "none"):
            raise ValueError(f"fp8 scaling={self.scaling!r}; expected 'current', 'delayed' or 'none'")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"fp8 amax_compute_algo={self.amax_compute_algo!r}; expected 'max' or 'most_recent'")
        for field, low in (("amax_history_len", 1), ("margin", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"fp8 {field} must be an integer >= {low}, got {v!r}")
        if float(np.float32(fp8_max(E4M3) * 2.0 ** (-int(self.margin)))) == 0.0:
            raise ValueError(f"fp8 margin={self.margin}: 2**-margin times the fp8 maximum underflows f32 to 0, so "
                             "every scale would be 0; margins are small integers (TE's default 0)")
        top = max_margin()
        if self.margin > top:  # (the torch side's bound: mixprec.fp8.options)
            raise ValueError(f"fp8 margin={self.margin}: the scale puts a tensor's largest value at fp8_max * "
                             f"2**-margin, which past margin {top} is below e4m3's smallest normal (every cast would "
                             f"lose its precision); use a margin from 0 (TE's default) to {top}")
        if self.scaling != "delayed":  # read by delayed scaling only: given otherwise, they would be ignored
            given = [f for f, d in (("amax_history_len", 1024), ("amax_compute_algo", "max"), ("margin", 0))
                     if getattr(self, f) != d]
            if given:
                raise ValueError(f"fp8 {', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to delayed "
                                 f"scaling only; with scaling={self.scaling!r} {'they' if len(given) > 1 else 'it'} "
                                 "would be ignored. Drop it, or use scaling='delayed'")
        try:
            formats = tuple(jnp.dtype(f) for f in self.formats)
        except TypeError:
            formats = ()
        if len(formats) != 3 or any(f not in FORMAT_NAMES for f in formats):
            raise ValueError(f"fp8 formats must be three of float8_e4m3fn / float8_e5m2, got {self.formats!r}")
        object.__setattr__(self, "formats", formats)

    @classmethod
    def from_spec(cls, spec: Any) -> Fp8Config:
        """From the torch side's ``mixprec.recipes.Fp8Spec``; what only torch implements is refused."""
        if spec.granularity != "tensorwise":
            raise ValueError(
                f"fp8 granularity={spec.granularity!r}: mixprec.jax scales per tensor only (rowwise scaling is "
                "torch-only); use granularity='tensorwise'"
            )
        if spec.pow2_scales:
            raise ValueError("fp8 pow2_scales: power-of-two scales are torch-only (the torch side rounds them with "
                             "log2/exp2, which XLA computes differently); use pow2_scales=False")
        if spec.gemm == "scaled_mm":
            raise ValueError("fp8 gemm='scaled_mm' names torch._scaled_mm; mixprec.jax multiplies dequantized fp8 "
                             "operands with f32 accumulation (which XLA lowers to fp8 GEMMs where the GPU has them): "
                             "use gemm='auto'")
        return cls(role_formats(spec.format), spec.scaling, spec.amax_history_len,
                   spec.amax_compute_algo, spec.margin)

    def scale(self, t: jax.Array, role: int, delayed: jax.Array | None) -> jax.Array:
        """The scale that casts ``t`` in ``role``: from ``t`` (current), the delayed scales, or 1."""
        if self.scaling == "current":
            return current_scale(amax(t), self.formats[role])
        if self.scaling == "delayed":
            assert delayed is not None
            return delayed[role]
        return jnp.ones((), jnp.float32)

    def describe(self) -> str:
        names = "/".join(FORMAT_NAMES[jnp.dtype(f)] for f in self.formats)
        if self.scaling == "delayed":
            how = f"delayed scaling, amax history {self.amax_history_len} ({self.amax_compute_algo}), margin {self.margin}"
        elif self.scaling == "current":
            how = "current scaling (per tensor)"
        else:
            how = "NO scaling (scale 1)"
        return f"fp8 {names}, {how}"
