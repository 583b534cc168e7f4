"""The scalers' exception types (raised by ``bounds``, ``scaler`` and ``static``; relies on nothing)."""

from __future__ import annotations


class ScaleFloorError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``."""


class ScalerConfigError(ValueError, AssertionError):
    """Bad scaler configuration. Also an AssertionError: torch's GradScaler raises that type."""


class ScaleTypeError(TypeError, AssertionError):
    """A new scale of the wrong type. Also an AssertionError: torch's GradScaler raises that type."""
