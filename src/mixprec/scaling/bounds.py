"""mixprec's bounds on the dynamic scale: hysteresis, floor and ceiling, and what an overflow at the floor does.

Holds ``OnFloor``, the checks of the bounds arguments (``_check_bounds``), and ``_Bounds``, the
``GradScaler`` mixin that computes a bounded update on the device (``_update_with_bounds``: used
instead of torch's fused ``_amp_update_scale_`` whenever a bound or hysteresis is set, ``_plain``
says when), reports overflows at the floor (``check_floor``) and keeps the host-side
power-of-two bookkeeping (``_pow2``, ``scale_is_power_of_two``).

Relies on the attributes ``GradScaler.__init__`` (``mixprec.scaling.scaler``) sets: ``_enabled``,
the factors, ``_growth_interval``, ``_hysteresis``, ``_consecutive_hysteresis``, ``_min_scale``,
``_max_scale``, ``_on_floor``, the device counters ``_hysteresis_tracker`` and ``_floor_hits``,
``_floor_hits_reported``, ``_pow2`` and ``_last_host_skipped`` (set by ``update()``).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Literal

import torch

from mixprec.scaling.errors import ScaleFloorError, ScalerConfigError

OnFloor = Literal["raise", "warn", "skip"]


def _is_power_of_two(x: Any) -> bool:
    """A positive finite float whose mantissa is exactly 1 (multiplying by it, or by its
    reciprocal, is exact in binary floating point unless the result leaves the format's range)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


def _finite_real(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x)


def _check_growth_factor(growth_factor: Any) -> None:
    """torch's check (and message) for a number <= 1; also refuses what torch lets through and then
    fails on later or never (NaN, inf, a string): such a scaler's state_dict() would not load back."""
    if not _finite_real(growth_factor):
        raise ScalerConfigError(f"The growth factor must be a finite number > 1.0 (2.0 is torch's default), "
                                f"got {growth_factor!r}")
    if growth_factor <= 1.0:
        raise ScalerConfigError("The growth factor must be > 1.0.")


def _check_backoff_factor(backoff_factor: Any) -> None:
    """torch's check (and message) for a number >= 1; also refuses NaN, and 0 or less (torch takes
    them: a NaN or a zero/negative scale after the first overflow)."""
    if not _finite_real(backoff_factor):
        raise ScalerConfigError(f"The backoff factor must be a finite number in (0, 1) (0.5 is torch's default), "
                                f"got {backoff_factor!r}")
    if backoff_factor >= 1.0:
        raise ScalerConfigError("The backoff factor must be < 1.0.")
    if backoff_factor <= 0.0:
        raise ScalerConfigError(f"The backoff factor must be > 0 (0.5 is torch's default), got {backoff_factor!r}")


def _check_growth_interval(growth_interval: Any) -> int:
    """An integer >= 1 (torch takes anything, and a float or a string fails at the first ``update()``)."""
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral) or growth_interval < 1:
        raise ScalerConfigError(f"growth_interval must be an integer >= 1 (clean steps before the scale grows; "
                                f"2000 is torch's default), got {growth_interval!r}")
    return int(growth_interval)


def _check_bounds(
    init_scale: float, hysteresis: int, min_scale: float | None, max_scale: float | None, on_floor: Any
) -> None:
    """Raise ``ScalerConfigError`` for bounds arguments ``GradScaler`` cannot honour."""
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not math.isfinite(init_scale) \
            or not init_scale > 0:
        # torch accepts 0 (the first step's weights become NaN and the step is not even skipped)
        raise ScalerConfigError(f"init_scale must be a finite number > 0 (2**16 is torch's default), got {init_scale!r}")
    if int(hysteresis) < 1:
        raise ScalerConfigError(f"hysteresis must be an integer >= 1 (1 = torch's behaviour), got {hysteresis}")
    if min_scale is not None and not min_scale > 0:
        raise ScalerConfigError(f"min_scale must be > 0 or None, got {min_scale}")
    if max_scale is not None and min_scale is not None and max_scale < min_scale:
        raise ScalerConfigError(f"max_scale ({max_scale}) is below min_scale ({min_scale})")
    if on_floor not in ("raise", "warn", "skip"):
        raise ScalerConfigError(f"on_floor must be 'raise', 'warn' or 'skip', got {on_floor!r}")
    if min_scale is not None and init_scale < min_scale:
        raise ScalerConfigError(f"init_scale ({init_scale}) is below min_scale ({min_scale})")
    if max_scale is not None and init_scale > max_scale:
        raise ScalerConfigError(f"init_scale ({init_scale}) is above max_scale ({max_scale})")


class _Bounds:
    """Hysteresis, floor and ceiling of the dynamic scale, and the power-of-two bookkeeping."""

    def _all_powers_of_two(self, scale: Any) -> bool:
        """Whether every scale this scaler can reach from ``scale`` is a power of two: the scale,
        both factors and the bounds are (products and clamps of powers of two stay powers of two)."""
        return all(_is_power_of_two(v) for v in (scale, self._growth_factor, self._backoff_factor,
                                                  self._min_scale or 1.0, self._max_scale or 1.0))

    @property
    def scale_is_power_of_two(self) -> bool:
        """True when the scale is known to be a power of two (host state, no sync): the default
        factors keep it so, and then ``x * (1/scale)`` is exact, so a norm of scaled gradients times
        ``1/scale`` is bitwise the norm of the unscaled ones. False is conservative (a factor or a
        bound that is not a power of two, or a scale set from a tensor)."""
        return self._enabled and self._pow2

    @property
    def _plain(self) -> bool:
        """True when the update rule is exactly torch's (one fused kernel does it)."""
        return self._hysteresis == 1 and self._min_scale is None and self._max_scale is None

    def _update_with_bounds(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor) -> None:
        """Hysteresis, floor and ceiling, computed on the device (no host sync).

        Products are formed in float64 and rounded once to float32, as torch's kernel does with its
        double factors, so factors that are not powers of two round the same way.
        """
        hyst, floor_hits = self._hysteresis_tracker, self._floor_hits
        assert hyst is not None and floor_hits is not None
        scale64 = scale.double()
        # overflow: lower the scale only once the hysteresis counter has run down to 1
        lower = found & (hyst <= 1)
        lowered = scale64 * self._backoff_factor
        if self._min_scale is not None:
            floor_hit = lower & (scale <= self._min_scale)
            floor_hits.add_(floor_hit)
            lowered = lowered.clamp(min=self._min_scale)
        # clean: grow after growth_interval consecutive clean steps (if the result is finite)
        counted = tracker + 1
        grow = ~found & (counted >= self._growth_interval)
        grown = scale64 * self._growth_factor
        if self._max_scale is not None:
            grown = grown.clamp(max=self._max_scale)
        grown = torch.where(torch.isfinite(grown.float()), grown, scale64)
        new_scale = torch.where(lower, lowered, torch.where(grow, grown, scale64)).float()
        new_tracker = torch.where(found | grow, torch.zeros_like(tracker), counted)
        refill = ~found if self._consecutive_hysteresis else grow
        new_hyst = torch.where(found & (hyst > 1), hyst - 1, torch.where(refill, torch.full_like(hyst, self._hysteresis), hyst))
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)
        if self._min_scale is not None and self._on_floor != "skip" and self._last_host_skipped:
            # The host already knows this step overflowed (unfused step synced): one more read,
            # on overflow steps only, tells whether it happened at the floor.
            self.check_floor()

    def check_floor(self) -> None:
        """Raise or warn (per ``on_floor``) if gradients overflowed at ``min_scale`` since the last check.

        Reads a device counter, so it syncs; ``update()`` calls it itself only on overflow steps of
        unfused optimizers, where the host already synced.
        """
        if not self._enabled or self._min_scale is None or self._floor_hits is None or self._on_floor == "skip":
            return
        hits = int(self._floor_hits.item())
        if hits <= self._floor_hits_reported:
            return
        self._floor_hits_reported = hits
        msg = (
            f"Gradients overflowed with the loss scale already at its floor (min_scale={self._min_scale:g}); "
            f"{hits} such step(s) so far were skipped. The scale cannot go lower: the gradients are "
            "non-finite at any scale, which points at the model, not the scaler. Check the same step in "
            "fp32 ('mixprec doctor'), or use bf16."
        )
        if self._on_floor == "raise":
            raise ScaleFloorError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
