"""The numbers a loss scale multiplies by: of fixed type (float32) when the scale was given weakly typed (a Python
number, ``StaticLossScale(2 ** 15)`` as jmp writes it), and the checks of a floor against the scale's dtype."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["warn_if_not_floating"]


def _weak(value: Any) -> bool:
    """A Python number, or an array that jax types weakly (made from one): it takes the other operand's dtype."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or bool(getattr(value, "weak_type", False))


def _strong(value: Any) -> Any:
    """The scale as a float32 value of fixed type when it is weakly typed, else itself. ``StaticLossScale(2 ** 15)``
    (jmp's own spelling) would otherwise take the dtype of what it multiplies: an fp16 loss scaled in fp16
    overflows above 2 at 2**15."""
    if not _weak(value):
        return value
    if isinstance(value, (int, float)):
        return np.float32(value)
    return value.astype(jnp.float32)


def _reciprocal(value: Any) -> Any:
    """``1 / scale``, float32 (of fixed type) when the scale is weakly typed: a weak reciprocal takes the gradients'
    dtype, and fp16 gradients unscaled in fp16 lose the small values the scale was protecting."""
    if not _weak(value):
        return 1 / value
    if isinstance(value, (int, float)):
        return np.float32(1.0 / value)
    return (1 / value).astype(jnp.float32)


def _check_floor(scale: Any, floor: np.ndarray) -> None:
    """A scale below its floor (an overflow would raise it to the floor), or a floor that is 0 in the scale's
    dtype (the scale would reach 0 and every later step be skipped: unscaling by 1/0)."""
    a = np.asarray(scale)
    dtype = a.dtype if np.issubdtype(a.dtype, np.floating) else np.dtype(np.float32)
    if a.dtype != object and np.issubdtype(a.dtype, np.number) and (a.astype(np.float64) < floor).any():
        raise ValueError(
            f"DynamicLossScale: loss_scale ({a.tolist()}) is below min_loss_scale ({floor.tolist()}): an overflow would "
            "raise it to the floor; pass a lower min_loss_scale (e.g. min_loss_scale=jnp.float32(2.0**-14))"
        )
    in_dtype = floor.astype(dtype)
    if not (np.isfinite(in_dtype) & (in_dtype > 0)).all():
        raise ValueError(
            f"DynamicLossScale: min_loss_scale ({floor.tolist()}) is {in_dtype.tolist()} in the scale's dtype {dtype.name}: "
            "the scale could fall to it and every later step be skipped; use a floor the dtype holds (float16: "
            ">= 2**-24) or a float32 loss_scale"
        )


def warn_if_not_floating(x: Any, var_name: str) -> None:
    """Produces a warning if the given array does not have a floating type (as jmp).

    jax builds pytrees with ``object()`` placeholders while compiling; those are skipped.
    """
    if type(x) is object or x is None:
        return
    x_dtype = jax.eval_shape(lambda: x).dtype
    if not jnp.issubdtype(x_dtype, jnp.floating):
        warnings.warn(f"Expected floating type for {var_name}, got {x_dtype}")
