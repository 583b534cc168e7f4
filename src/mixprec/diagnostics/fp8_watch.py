"""The NaN guard's fp8 part: name the fp8 layers whose casts saturate, and warn about the ones that matter.

An fp8 cast clamps (``mixprec.fp8.casts``): a value past the format's range becomes its largest
finite value, never inf or NaN, so a saturating fp8 layer is invisible to a non-finite check. When
the guarded model has fp8 layers, the guard also counts, per cast, the values the clamp caught
(one comparison and one sum per cast, read with the guard's own checks):

- every (layer, tensor) that saturated in a checked pass is an ``Fp8Saturation`` in
  ``guard.fp8_saturations``: the per-step record, benign events included;
- an event *matters* when it is a spike against the layer's own history (its amax at least
  ``spike`` times the largest of its last ``history`` steps: delayed scaling casts it with the quiet
  steps' scale) or when at least ``fraction`` of the cast's values saturated. A healthy run
  saturates a little now and then (0.006%-2.7% of a cast in the first steps of fp8-delayed, the
  amax creeping up by a few percent): that is recorded, not warned about;
- in "warn" and "raise" modes the events that matter become one ``Fp8SaturationWarning`` per
  window of ``window`` guard steps, listing the worst tensors: the first at once, the rest of the
  window's in one summary when it closes (or when the guard detaches). Saturation is damage to
  look at, not a fault that stops the step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Any

from torch import nn

from mixprec.fp8 import CastObserver, fp8_layers

#: the defaults of what matters: a x8 spike against the last 16 steps, 5% of a cast saturated; one warning per 50 steps
SPIKE, HISTORY, FRACTION, WINDOW = 8.0, 16, 0.05, 50


class Fp8SaturationWarning(UserWarning):
    """fp8 casts saturated in a way that matters (values clamped to the format's largest finite value)."""


@dataclasses.dataclass(frozen=True)
class Fp8Saturation:
    """One fp8 layer's cast that saturated in a checked pass.

    ``spike``: its amax over the largest of the layer's own last steps (NaN: no history yet);
    ``matters``: a spike of at least ``SPIKE`` or a saturated fraction of at least ``FRACTION``."""

    layer: str
    role: str  # input, weight or grad_output
    fmt: str
    saturated: int
    numel: int
    scale: float
    amax: float
    step: int  # the guard's forward count when it was read
    spike: float = math.nan
    matters: bool = True

    @property
    def fraction(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    def describe(self) -> str:
        spike = f", {self.spike:.3g}x its recent max" if self.spike == self.spike else ""
        return (f"fp8 layer {self.layer}: {self.saturated} of {self.numel} {self.role} values ({100 * self.fraction:.3g}%) "
                f"saturated in {self.fmt} (step {self.step}; scale {self.scale:.4g}, amax {self.amax:.4g}{spike} > "
                f"{self.fmt} max / scale)")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fraction": self.fraction}


ADVICE = ("Delayed scaling saturates after an amax spike until its history catches up; if it persists, use current "
          "scaling (fp8-current), a margin, or keep the layer in bf16 (fp8={'exclude': [...]})")


def summary(events: list[Fp8Saturation], minor: int, n: int = 3, spike: float = SPIKE, fraction: float = FRACTION) -> str:
    """One warning's text: the steps, how many events, the ``n`` worst (largest fraction, then spike)."""
    worst = sorted(events, key=lambda e: (-e.fraction, -(e.spike if e.spike == e.spike else 0.0)))[:n]
    first, last = min(e.step for e in events), max(e.step for e in events)
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    tail = f" (and {minor} minor ones since the last warning, recorded only)" if minor else ""
    return (f"fp8 casts saturated in {steps}: {len(events)} that matter (a x{spike:g} spike against the layer's own "
            f"history, or >= {100 * fraction:g}% of a cast){tail}; worst: " + "; ".join(e.describe() for e in worst)
            + f". Every event is in guard.fp8_saturations. {ADVICE}")


class SaturationWatch:
    """Counts saturated values in a model's fp8 casts (``None`` from ``for_model`` when it has none)."""

    def __init__(self, model: nn.Module, *, spike: float = SPIKE, history: int = HISTORY, fraction: float = FRACTION,
                 window: int = WINDOW) -> None:
        self.observer = CastObserver(model, full=False)
        self.spike, self.fraction, self.window = spike, fraction, window
        self._amax: dict[tuple[str, str], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=history))
        self._pending: list[Fp8Saturation] = []  # events that matter, not warned about yet
        self._minor = 0
        self._window_end: int | None = None  # warnings wait until this guard step
        self._warn = False

    @classmethod
    def for_model(cls, model: nn.Module) -> "SaturationWatch | None":
        return cls(model) if fp8_layers(model) else None

    def attach(self) -> None:
        self.observer.attach()

    def detach(self) -> None:
        """Stop watching; what matters and was not warned about yet is said now."""
        self.observer.detach()
        self._flush()

    def take(self, step: int, warn: bool = False) -> list[Fp8Saturation]:
        """The casts that saturated since the last take (one host sync when any cast was seen); with
        ``warn``, the events that matter are warned about as the module docstring says."""
        self._warn = warn
        out = []
        for c in self.observer.read():
            seen = self._amax[(c.layer, c.role)]
            before = max(seen, default=0.0)
            seen.append(c.amax)
            if not c.saturated:
                continue
            spike = c.amax / before if before > 0 else math.nan
            matters = c.saturated >= self.fraction * c.numel or spike >= self.spike
            ev = Fp8Saturation(c.layer, c.role, c.fmt, c.saturated, c.numel, c.scale, c.amax, step, spike, matters)
            out.append(ev)
            if matters:
                self._pending.append(ev)
            else:
                self._minor += 1
        if self._pending and (self._window_end is None or step >= self._window_end):
            self._flush()
            self._window_end = step + self.window
        return out

    def _flush(self) -> None:
        if self._pending and self._warn:
            warnings.warn(summary(self._pending, self._minor, spike=self.spike, fraction=self.fraction),
                          Fp8SaturationWarning, stacklevel=4)
        self._pending, self._minor = [], 0
