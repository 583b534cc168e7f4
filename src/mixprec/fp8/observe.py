"""Watching the casts of fp8 linears: what each one flushed to zero, saturated, and how faithful it was.

Diagnostics (the NaN guard, the probes, ``doctor``) attach a ``CastObserver`` to a model's fp8
layers; every cast then adds a few reductions on the device (counts, and for ``full=True`` the signal
and noise power), and ``read()`` fetches them all in one transfer. Observers compose: a layer holds
a tuple of them (``fp8_observers``), each sees every cast, and ``detach`` removes only its own (a
probe run while the guard watches leaves the guard watching). Eager only: a compiled model is
watched with its observers detached (the tuple is empty then, and costs nothing).

Per (layer, role) and over every cast since the last read:

- ``zero``: of the nonzero values, the fraction the cast made 0 (``|x * s|`` at or below half the
  smallest subnormal: underflow at the current scale);
- ``saturated``: of all values, the fraction the clamp caught (``|x * s|`` at or past the largest
  finite value plus half an ulp: they would have overflowed);
- ``sqnr_db``: ``10 log10(sum x^2 / sum (x - x_q / s)^2)`` (full observers only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from mixprec.fp8.casts import ROLES, FloatFormat, dequantize_raw, saturation_threshold
from mixprec.fp8.swap import fp8_layers


@dataclasses.dataclass
class CastStats:
    """One cast role of one fp8 layer, over the casts observed (``casts`` of them)."""

    layer: str
    role: str
    fmt: str
    numel: int
    nonzero: int
    zeros: int  # nonzero values that became 0
    saturated: int
    signal: float  # sum of x^2 (nan when not measured)
    noise: float  # sum of (x - dequantized)^2
    amax: float
    scale: float  # the (last) tensorwise scale; for rowwise scales, the smallest
    casts: int = 1

    @property
    def zero(self) -> float:
        return self.zeros / self.nonzero if self.nonzero else 0.0

    @property
    def flushed_fraction(self) -> float:
        """Of the nonzero values, the fraction the cast made 0 (``zero``, by its plain name): a population
        lost whatever the SQNR says (1.5% of a layer's inputs can flush while SQNR reads 31 dB)."""
        return self.zero

    @property
    def scale_deficit(self) -> float:
        """How many times the scale is smaller than the tensor's own (``fp8_max / amax``): 1 when the
        largest value lands on the format's maximum; 2660 after a spike left a delayed scale behind
        (the tensor then uses 1/2660 of the range and its small values flush). NaN without an amax."""
        from mixprec.formats import get_format

        if not self.amax > 0 or not self.scale > 0:
            return float("nan")
        return get_format(self.fmt).max / (self.amax * self.scale)

    @property
    def saturation(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def sqnr_db(self) -> float:
        if math.isnan(self.signal) or math.isnan(self.noise):
            return float("nan")
        if self.noise == 0:
            return float("inf")
        return 10 * math.log10(self.signal / self.noise) if self.signal > 0 else float("-inf")

    def merge(self, other: "CastStats") -> None:
        self.numel += other.numel
        self.nonzero += other.nonzero
        self.zeros += other.zeros
        self.saturated += other.saturated
        self.signal += other.signal
        self.noise += other.noise
        self.amax = max(self.amax, other.amax)
        self.scale = other.scale
        self.casts += other.casts

    def describe(self) -> str:
        deficit = self.scale_deficit
        behind = f" (the scale is {deficit:.3g}x below the tensor's range)" if deficit >= 2 else ""
        return (f"{self.layer} {self.role} ({self.fmt}, scale {self.scale:.4g}, amax {self.amax:.4g}): "
                f"{100 * self.zero:.2f}% of nonzero values flushed to 0{behind}, {100 * self.saturation:.3f}% saturated, "
                f"SQNR {self.sqnr_db:.1f} dB")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "zero": self.zero, "flushed_fraction": self.flushed_fraction,
                "scale_deficit": self.scale_deficit, "saturation": self.saturation, "sqnr_db": self.sqnr_db}


class _Bound:
    """The observer as one layer sees it (the layer calls ``cast``)."""

    __slots__ = ("observer", "name")

    def __init__(self, observer: "CastObserver", name: str) -> None:
        self.observer, self.name = observer, name

    def cast(self, role: int, x_hp: torch.Tensor, x_q: torch.Tensor, s: torch.Tensor, fmt: FloatFormat) -> None:
        self.observer.record(self.name, role, x_hp, x_q, s, fmt)


class CastObserver:
    """Collects ``CastStats`` from the fp8 layers it is attached to (``attach``/``detach``, or ``with``).

    Args:
        model: the model whose ``Fp8Linear`` layers to watch.
        full: also measure the signal and noise power (SQNR); else only the counts (cheaper).
    """

    def __init__(self, model: nn.Module, full: bool = True) -> None:
        self.model = model
        self.full = full
        self._pending: list[tuple[str, int, str, torch.Tensor]] = []
        self._layers: list[Any] = []

    def attach(self) -> "CastObserver":
        """Start watching every fp8 layer of the model (beside any other observer; twice is once)."""
        self.detach()
        layers = fp8_layers(self.model)
        for name, m in layers:
            m.fp8_observers = (*m.fp8_observers, _Bound(self, name or m.fp8_name or "(model)"))
        self._layers = [m for _, m in layers]
        return self

    def detach(self) -> None:
        """Stop watching; other observers of the same layers keep theirs."""
        for m in self._layers:
            m.fp8_observers = tuple(b for b in m.fp8_observers if b.observer is not self)
        self._layers = []

    def __enter__(self) -> "CastObserver":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    @property
    def watching(self) -> bool:
        return bool(self._layers)

    @torch.no_grad()
    def record(self, name: str, role: int, x_hp: torch.Tensor, x_q: torch.Tensor, s: torch.Tensor,
               fmt: FloatFormat) -> None:
        with torch._C.DisableTorchFunction():  # out of sight of the NaN guard's op mode: ours, not the model's
            self._record(name, role, x_hp, x_q, s, fmt)

    def _record(self, name: str, role: int, x_hp: torch.Tensor, x_q: torch.Tensor, s: torch.Tensor,
                fmt: FloatFormat) -> None:
        x = x_hp.detach().float()
        scaled = (x * s).abs()
        nonzero = x != 0
        f64 = torch.float64  # counts past 2**24 stay exact, sums of squares keep their digits
        vals = [torch.tensor(float(x.numel()), dtype=f64, device=x.device), nonzero.sum().to(f64),
                (nonzero & (x_q.float() == 0)).sum().to(f64), (scaled >= saturation_threshold(fmt)).sum().to(f64)]
        if self.full:
            d = x.double()
            vals += [d.square().sum(), (d - dequantize_raw(x_q, s).double()).square().sum()]
        else:
            vals += [torch.full((), float("nan"), dtype=f64, device=x.device)] * 2
        vals += [x.abs().amax().to(f64) if x.numel() else torch.zeros((), dtype=f64, device=x.device),
                 s.detach().amin().to(f64)]
        self._pending.append((name, role, fmt.name, torch.stack(vals)))

    def read(self) -> list[CastStats]:
        """The stats since the last read, one per (layer, role), in the order first seen (one sync)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        with torch._C.DisableTorchFunction():
            rows = torch.stack([p[3].to(pending[0][3].device) for p in pending]).cpu().tolist()
        out: dict[tuple[str, int], CastStats] = {}
        for (name, role, fmt, _), r in zip(pending, rows):
            st = CastStats(name, ROLES[role], fmt, int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4], r[5], r[6], r[7])
            if (name, role) in out:
                out[(name, role)].merge(st)
            else:
                out[(name, role)] = st
        return list(out.values())


class preserve_scaling_state:
    """Context manager: the delayed-scaling histories and scales of ``model`` are put back on exit,
    so that a probe's forward and backward leave no trace in them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> "preserve_scaling_state":
        self.saved = [(t, t.clone()) for _, m in fp8_layers(self.model)
                      for t in (getattr(m, "fp8_amax_history", None), getattr(m, "fp8_scale", None)) if t is not None]
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for t, copy in self.saved:
                t.copy_(copy)
