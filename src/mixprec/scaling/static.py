"""The two fixed-scale siblings of ``GradScaler``: ``StaticLossScaler`` and ``NoOpScaler``.

Both are ``GradScaler`` subclasses (``mixprec.scaling.scaler``), so every trainer sees one
interface: the static scaler replaces the update rule with nothing (``_plain`` False routes
``update()`` to its empty ``_update_with_bounds``), and the no-op one is a disabled scaler.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling.errors import ScalerConfigError
from mixprec.scaling.scaler import GradScaler


class StaticLossScaler(GradScaler):
    """A fixed loss scale with the same interface: steps with inf/NaN gradients are skipped, the
    scale never changes. ``StaticLossScaler(1.0)`` is a pure non-finite-step guard.

    >>> s = StaticLossScaler(2.0**12, device="cpu")
    >>> s.get_scale()
    4096.0
    """

    def __init__(self, scale: float = 2.0**15, device: str = "cuda", enabled: bool = True, **kwargs: Any) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ScalerConfigError(f"StaticLossScaler needs a scale > 0 (a number), got {scale!r}")
        # growth_interval is never reached: _update_with_bounds is replaced below.
        super().__init__(device, init_scale=scale, enabled=enabled, **kwargs)

    @property
    def _plain(self) -> bool:
        return False

    def _update_with_bounds(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor) -> None:
        pass  # the scale is static; skipping is decided by step(), recording by update()


class NoOpScaler(GradScaler):
    """The scaler of recipes that need none (fp32, bf16): ``scale`` returns its input, ``step`` calls
    ``optimizer.step()``, everything else does nothing. One training loop serves every recipe.

    >>> NoOpScaler().get_scale(), NoOpScaler().state_dict()
    (1.0, {})
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device, enabled=False)
