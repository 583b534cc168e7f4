"""The scalers' two exception types (raised by ``bounds``, ``scaler`` and ``static``; relies on nothing)."""

from __future__ import annotations


class ScaleFloorError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``."""


class ScalerConfigError(ValueError, AssertionError):
    """Bad scaler configuration. Also an AssertionError: torch's GradScaler raises that type."""
