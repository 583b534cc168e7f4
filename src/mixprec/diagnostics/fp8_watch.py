"""The NaN guard's fp8 part: name the fp8 layers whose casts saturate.

An fp8 cast clamps (``mixprec.fp8.casts``): a value past the format's range becomes its largest
finite value, never inf or NaN, so a saturating fp8 layer is invisible to a non-finite check. When
the guarded model has fp8 layers, the guard also counts, per cast, the values the clamp caught
(one comparison and one sum per cast, read with the guard's own checks) and reports each
(layer, tensor) that saturated as an ``Fp8Saturation``: in ``guard.fp8_saturations``, and as an
``Fp8SaturationWarning`` once per place in "warn" and "raise" modes (saturation is damage to
look at, not a fault that stops the step: delayed scaling saturates for one step after an amax
spike by design).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from mixprec.fp8 import CastObserver, fp8_layers


class Fp8SaturationWarning(UserWarning):
    """An fp8 layer's cast saturated (values clamped to the format's largest finite value)."""


@dataclasses.dataclass(frozen=True)
class Fp8Saturation:
    """One fp8 layer's cast that saturated in a checked pass."""

    layer: str
    role: str  # input, weight or grad_output
    fmt: str
    saturated: int
    numel: int
    scale: float
    amax: float
    step: int  # the guard's forward count when it was read

    @property
    def fraction(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    def describe(self) -> str:
        return (f"fp8 layer {self.layer}: {self.saturated} of {self.numel} {self.role} values ({100 * self.fraction:.3g}%) "
                f"saturated in {self.fmt} (step {self.step}; scale {self.scale:.4g}, amax {self.amax:.4g} > "
                f"{self.fmt} max / scale). Delayed scaling saturates after an amax spike until its history catches up; "
                "if it persists, use current scaling (fp8-current), a margin, or keep this layer in bf16 "
                "(fp8={'exclude': [...]})")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fraction": self.fraction}


class SaturationWatch:
    """Counts saturated values in a model's fp8 casts (``None`` from ``for_model`` when it has none)."""

    def __init__(self, model: nn.Module) -> None:
        self.observer = CastObserver(model, full=False)

    @classmethod
    def for_model(cls, model: nn.Module) -> "SaturationWatch | None":
        return cls(model) if fp8_layers(model) else None

    def attach(self) -> None:
        self.observer.attach()

    def detach(self) -> None:
        self.observer.detach()

    def take(self, step: int) -> list[Fp8Saturation]:
        """The casts that saturated since the last take (one host sync when any cast was seen)."""
        return [Fp8Saturation(c.layer, c.role, c.fmt, c.saturated, c.numel, c.scale, c.amax, step)
                for c in self.observer.read() if c.saturated]
