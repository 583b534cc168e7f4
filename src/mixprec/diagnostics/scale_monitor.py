"""Scale monitor: is the loss scale probing (a sawtooth) or collapsing, and which layer overflowed?

``diagnose_scale(history)`` reads a scaler's record (``GradScaler.history()``: step, scale used,
skipped) and says which of these it is:

- ``no-overflow``: no step was skipped.
- ``settling``: the only skips are the run of halvings at the start, from the initial scale down
  to what the gradients allow. Normal.
- ``sawtooth``: overflows followed by growth: the scaler probing its ceiling. Healthy.
- ``probing``: overflows, the scale holding its level, no growth yet (the run is shorter than the
  growth interval). Healthy so far.
- ``collapse``: the scale keeps falling without recovering (``collapse_bits`` halvings below where
  it settled), or every recent step is skipped. The gradients are non-finite at any scale: the
  model is at fault, not the scaler.

``ScaleMonitor(scaler, model)`` also names the parameters whose gradients were non-finite on each
overflow step (no existing scaler says which layer overflowed). What it costs:

- Unfused optimizers: the scaler's ``step`` already read found_inf on the host. The monitor wraps
  ``scaler.update`` and, only on steps the host knows were skipped, computes one
  ``_foreach_norm(inf)`` over the gradients and reads it: zero work and zero syncs on clean steps.
- Fused optimizers (``fused=True``; the host does not know): every step it computes the per-parameter
  non-finite flags on the device (one ``_foreach_norm`` over the gradients, no sync) into a ring
  buffer, read when you call ``overflows()`` or ``diagnose()``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ScaleDiagnosis:
    """Attributes: verdict (see the module doc), healthy, message, steps, skipped, backoffs,
    growths, settled_scale (after the initial descent), final_scale, min_scale_seen."""

    verdict: str
    healthy: bool
    message: str
    steps: int
    skipped: int
    backoffs: int
    growths: int
    settled_scale: float | None
    final_scale: float | None
    min_scale_seen: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _as_lists(history: Any) -> tuple[list[float], list[bool]]:
    if hasattr(history, "history") and callable(history.history):
        history = history.history()
    scales = [float(s) for s in torch.as_tensor(history["scale"]).tolist()]
    skipped = [bool(s) for s in torch.as_tensor(history["skipped"]).tolist()]
    if len(scales) != len(skipped):
        raise ValueError(f"history has {len(scales)} scales but {len(skipped)} skipped flags")
    return scales, skipped


def diagnose_scale(history: Any, *, collapse_bits: int = 4, skip_streak: int = 8) -> ScaleDiagnosis:
    """Healthy probing or collapse, from ``scaler.history()`` (or the scaler itself).

    Args:
        history: a dict with ``scale`` (the scale each step used) and ``skipped``, or a ``GradScaler``.
        collapse_bits: a fall of this many halvings below the settled scale, not recovered, is collapse.
        skip_streak: this many consecutive skipped steps after settling is collapse.
    """
    scales, skipped = _as_lists(history)
    n = len(scales)
    if n == 0:
        return ScaleDiagnosis("no-data", True, "no steps recorded (is loss scaling on?)", 0, 0, 0, 0, None, None, None)
    n_skip = sum(skipped)
    # The scale a step used vs the next step's: a change is a backoff or a growth.
    backoffs = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
    growths = sum(1 for a, b in zip(scales, scales[1:]) if b > a)
    lead = 0
    while lead < n and skipped[lead]:
        lead += 1
    settled = scales[lead] if lead < n else None
    final = scales[-1]
    lowest = min(scales)
    common = (n, n_skip, backoffs, growths, settled, final, lowest)
    if n_skip == 0:
        return ScaleDiagnosis("no-overflow", True, f"no overflow in {n} steps; the scale stayed at or grew to {final:g}", *common)
    if lead == n:
        return ScaleDiagnosis(
            "collapse", False,
            f"every one of the {n} steps overflowed and was skipped; the scale fell from {scales[0]:g} to {final:g} "
            "without a single clean step: the gradients are non-finite at any scale (check the same step in fp32)",
            *common)
    rest_skips = sum(skipped[lead:])
    if rest_skips == 0:
        return ScaleDiagnosis(
            "settling", True,
            f"{lead} overflow(s) at the start took the scale from {scales[0]:g} to {settled:g}; no overflow since "
            "(normal: the scaler starts high and finds the ceiling)", *common)
    streak = 0
    for s in reversed(skipped):
        if not s:
            break
        streak += 1
    fall = math.log2(settled / final) if settled and final > 0 else math.inf
    recovering = any(b > a for a, b in zip(scales[lead:], scales[lead + 1:])) and final >= (settled or 0) / 2 ** (collapse_bits - 1)
    if streak >= skip_streak or (fall >= collapse_bits and not recovering) or final == 0:
        why = (f"the last {streak} steps were all skipped" if streak >= skip_streak
               else f"the scale fell {fall:.0f} halvings below where it settled ({settled:g} -> {final:g}) without recovering")
        return ScaleDiagnosis(
            "collapse", False,
            f"collapse: {why}; {n_skip} of {n} steps skipped. Repeated overflow at ever smaller scales means "
            "non-finite gradients that scaling cannot fix: run the same step in fp32 (mixprec doctor), "
            "look for the producing module (nan_guard), or use bf16", *common)
    if growths > 0:
        return ScaleDiagnosis(
            "sawtooth", True,
            f"healthy sawtooth: {rest_skips} overflow(s) after settling, each followed by growth; "
            f"{n_skip} of {n} steps skipped ({100 * n_skip / n:.1f}%)", *common)
    return ScaleDiagnosis(
        "probing", True,
        f"{rest_skips} overflow(s) after settling with the scale holding near {final:g}; no growth yet "
        "(fewer clean steps than the growth interval)", *common)


@dataclasses.dataclass(frozen=True)
class Overflow:
    """One skipped step: its index in the scaler's record, the scale it used, and the parameters
    whose gradients held inf/NaN, in registration order. ``nearest_loss`` is the last of them in that
    order: in a feed-forward model, where the overflow started (everything before it in the
    backward receives the non-finite gradient from it)."""

    step: int
    scale: float
    params: tuple[str, ...]

    @property
    def nearest_loss(self) -> str | None:
        return self.params[-1] if self.params else None


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad``, or for an fp32 master of a 16-bit parameter (``mp.parameters(model)``) whose
    gradient still waits on the model for its bucket (a skipped step), that 16-bit gradient."""
    g = p.grad
    if g is None:
        role = getattr(p, "_mixprec_role", None)
        if role is not None and role[0] == "proxy":
            g = role[1].pending_grad(p)
    return g


class ScaleMonitor:
    """Watch a ``GradScaler``: diagnose its scale and attribute each overflow to parameters.

    ``attach`` wraps the scaler's ``update`` (an instance attribute, so ``MixedPrecision.step``
    and hand-written loops both go through it); ``detach`` restores it. Detach before pickling or
    deep-copying the scaler.

    >>> import mixprec
    >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> scaler = mixprec.GradScaler("cpu", init_scale=2.0**126)  # weight grads 10 * 2^126 overflow fp32
    >>> with ScaleMonitor(scaler, net) as mon:
    ...     scaler.scale(net(torch.full((1, 2), 10.0)).sum()).backward(); _ = scaler.step(opt); scaler.update()
    >>> mon.overflows()[0].params
    ('weight',)
    """

    def __init__(self, scaler: Any, model: nn.Module | Iterable[tuple[str, nn.Parameter]], *, keep: int = 256) -> None:
        if not hasattr(scaler, "update") or not hasattr(scaler, "history"):
            raise TypeError(
                f"ScaleMonitor needs a mixprec GradScaler (with history()), got {type(scaler).__name__}; "
                "pass MixedPrecision(...).scaler or mixprec.GradScaler(...)"
            )
        self.scaler = scaler
        named = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
        self.names = tuple(n for n, _ in named)
        self.params = [p for _, p in named]
        self._known: list[Overflow] = []
        self._pending: deque[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = deque(maxlen=keep)
        self._original_update = None

    # ------------------------------------------------------------------ attach

    def attach(self) -> "ScaleMonitor":
        if self._original_update is None:
            self._original_update = self.scaler.update
            self.scaler.update = self._update  # instance attribute: MixedPrecision.step calls it too
        return self

    def detach(self) -> None:
        if self._original_update is not None:
            del self.scaler.update  # back to the class's method
            self._original_update = None

    def __enter__(self) -> "ScaleMonitor":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # ------------------------------------------------------------------ per step

    @torch.no_grad()  # a measurement: a guard watching the block must not take it for the model's op
    def _flags(self) -> tuple[torch.Tensor, list[int]] | None:
        """Device bool vector: parameter i's gradient held inf/NaN (no sync)."""
        grads = [_grad(p) for p in self.params]
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return None
        norms = torch._foreach_norm([grads[i] for i in idx], float("inf"))
        dev = norms[0].device
        return ~torch.isfinite(torch.stack([n.to(dev, torch.float32) for n in norms])), idx

    def _update(self, *args: Any, **kwargs: Any) -> None:
        step = getattr(self.scaler, "_updates", 0)
        self._original_update(*args, **kwargs)  # type: ignore[misc]
        if args or kwargs or not self.scaler.is_enabled():
            return  # update(new_scale) consumes no inf check
        host = getattr(self.scaler, "_last_host_skipped", None)
        if host is False:
            return  # clean step, and the host knows it: nothing to do
        got = self._flags()
        if got is None:
            return
        flags, idx = got
        scale = self.scaler.last_scale
        if host is True:  # the step's own sync already happened; one more read, on overflow steps only
            self._known.append(self._overflow(step, float(scale), flags.tolist(), idx))
        else:  # fused: keep the device flags, read later
            self._pending.append((step, scale, self.scaler.last_skipped, flags, torch.tensor(idx)))

    def _overflow(self, step: int, scale: float, flags: list[bool], idx: list[int]) -> Overflow:
        return Overflow(step, scale, tuple(self.names[i] for i, bad in zip(idx, flags) if bad))

    # ------------------------------------------------------------------ reading

    def overflows(self) -> list[Overflow]:
        """Every overflow step seen, oldest first (reads pending device flags: one sync)."""
        while self._pending:
            step, scale, skipped, flags, idx = self._pending.popleft()
            if bool(skipped):
                self._known.append(self._overflow(step, float(scale), flags.tolist(), idx.tolist()))
        return sorted(self._known, key=lambda o: o.step)

    def diagnose(self, **kwargs: Any) -> ScaleDiagnosis:
        """``diagnose_scale`` on the scaler's history."""
        return diagnose_scale(self.scaler.history(), **kwargs)

    def culprits(self) -> list[tuple[str, int]]:
        """Parameters nearest the loss on overflow steps, with how many overflows each started."""
        counts: dict[str, int] = {}
        for o in self.overflows():
            if o.nearest_loss:
                counts[o.nearest_loss] = counts.get(o.nearest_loss, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])
