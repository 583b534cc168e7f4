"""Judge a recipe's loss curve against fp32's own seed-to-seed noise.

The rule, in full (``VerdictRule.describe`` prints it with the numbers filled in):

1. Smooth every loss curve with an exponential moving average of span ``s`` steps.
2. The noise: the fp32 reference (seed 0) and fp32 runs from other seeds differ only in the
   initial weights. Their gap ``|fp32_seed_i - fp32_seed_0|``, at its largest over the seeds and
   over a window of ``s`` steps (so that a crossing of two curves does not pinch the band shut),
   times ``factor``, is the band half-width; never less than ``floor`` times the fp32 loss.
3. A candidate runs from seed 0, like the reference, so only the precision differs. It
   - is NON-FINITE when any step's loss is inf or NaN (reported: the first such step, and the loss
     scale history when a scaler was involved);
   - DIVERGES when its smoothed loss lies outside the band for ``patience`` consecutive steps after
     the first ``warmup`` steps (reported: the step the excursion began, the gap, and the gap as a
     multiple of the band);
   - TRACKS otherwise.
   When fp32 itself is non-finite the band does not exist: every candidate is UNJUDGED, and the
   fault is not the precision. A candidate that raised is ERROR.

Steps are numbered from 1 (the first optimizer step), as in the report. Pure numpy: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

Status = Literal["TRACKS", "DIVERGES", "NON-FINITE", "UNJUDGED", "ERROR"]


class Curves(Protocol):
    """What judging needs from a run (``RunResult`` has it)."""

    label: str
    recipe: str
    loss_scaling: str
    loss: np.ndarray
    scale: np.ndarray
    skipped: np.ndarray
    error: str | None


@dataclasses.dataclass(frozen=True)
class VerdictRule:
    """The parameters of the rule. ``None`` means: derived from the number of steps (see ``resolve``).

    Attributes:
        span: EMA span in steps (default: steps / 20, clamped to [5, 50]).
        factor: band half-width as a multiple of fp32's largest seed-to-seed gap.
        floor: the band is never narrower than this fraction of the smoothed fp32 loss.
        patience: consecutive out-of-band steps that make a divergence (default: the span, at
            most a quarter of the steps).
        warmup: leading steps not judged, while the average settles (default: as patience).
    """

    span: int | None = None
    factor: float = 2.0
    floor: float = 0.01
    patience: int | None = None
    warmup: int | None = None

    def __post_init__(self) -> None:
        for name in ("span", "patience", "warmup"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (1 if name != "warmup" else 0)):
                raise ValueError(f"VerdictRule.{name} must be a positive integer or None, got {v!r}")
        if not self.factor > 0:
            raise ValueError(f"VerdictRule.factor must be > 0, got {self.factor!r}")
        if not self.floor >= 0:
            raise ValueError(f"VerdictRule.floor must be >= 0, got {self.floor!r}")

    def resolve(self, steps: int) -> VerdictRule:
        """The same rule with every ``None`` replaced by its value for a run of ``steps`` steps."""
        span = self.span if self.span is not None else int(min(50, max(5, round(steps / 20))))
        quarter = max(1, steps // 4)  # short runs: still judge three quarters of the steps
        return dataclasses.replace(
            self,
            span=span,
            patience=self.patience if self.patience is not None else min(span, quarter),
            warmup=self.warmup if self.warmup is not None else min(span, quarter),
        )

    def describe(self, steps: int) -> str:
        r = self.resolve(steps)
        return (
            f"Loss curves are smoothed by an exponential moving average of span {r.span} steps. The fp32 "
            f"noise band is {r.factor:g} x the largest gap between the fp32 reference (seed 0) and fp32 "
            f"runs from other seeds (initial weights differ, data is the same), taken over the seeds and "
            f"a {r.span}-step window, and at least {r.floor:.0%} of the fp32 loss. Each recipe runs from "
            f"seed 0. NON-FINITE: a loss is inf or NaN at some step. DIVERGES: the smoothed loss is "
            f"outside the band for {r.patience} consecutive steps after step {r.warmup}. TRACKS: neither."
        )

    def summary(self, steps: int) -> str:
        """The rule in one line, for the terminal."""
        r = self.resolve(steps)
        return (
            f"EMA span {r.span}; band = {r.factor:g} x largest fp32 seed-to-seed gap (>= {r.floor:.0%} of loss); "
            f"DIVERGES = outside the band {r.patience} steps in a row after step {r.warmup}"
        )

    def to_dict(self, steps: int) -> dict[str, Any]:
        r = self.resolve(steps)
        return {**dataclasses.asdict(r), "text": self.describe(steps)}


@dataclasses.dataclass
class Verdict:
    """How one recipe compared with fp32.

    Attributes:
        label, recipe: the run judged.
        status: TRACKS, DIVERGES, NON-FINITE, UNJUDGED or ERROR.
        first_step: DIVERGES: the step the out-of-band excursion began; NON-FINITE: the first
            non-finite loss; else None.
        gap: smoothed candidate minus smoothed fp32 loss where ``ratio`` peaks (positive: worse).
        ratio: the largest ``|gap| / band`` over the judged steps (TRACKS keeps it under 1 for
            long stretches; 3.0 reads "three times the fp32 noise").
        final_gap: the smoothed gap at the last common step.
        scale: loss-scale history of scaler recipes: initial, min, max, final, skipped steps,
            first skipped step, and the scale at the first non-finite loss.
        message: one sentence for people.
    """

    label: str
    recipe: str
    status: Status
    message: str
    first_step: int | None = None
    gap: float | None = None
    ratio: float | None = None
    final_gap: float | None = None
    scale: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "TRACKS"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ok": self.ok}


# ---------------------------------------------------------------------------- curves


def ema(x: np.ndarray, span: int) -> np.ndarray:
    """Exponential moving average, alpha = 2 / (span + 1), started at the first value (no bias to 0)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    if not len(x):
        return out
    alpha = 2.0 / (span + 1.0)
    acc = x[0]
    for i, v in enumerate(x):
        acc = acc + alpha * (v - acc)
        out[i] = acc
    return out


def rolling_max(x: np.ndarray, window: int) -> np.ndarray:
    """Max over a centred window of ``window`` steps (shrunk at the ends)."""
    x = np.asarray(x, dtype=np.float64)
    half = window // 2
    return np.array([x[max(0, i - half) : i + half + 1].max() for i in range(len(x))])


@dataclasses.dataclass
class Band:
    """The fp32 reference (smoothed) and the band half-width around it, per step, and the rule
    (resolved for this many steps) that made them: candidates are judged by the same rule."""

    center: np.ndarray
    width: np.ndarray
    noise_gap: np.ndarray  # the largest smoothed seed-to-seed gap, before factor and floor
    rule: VerdictRule
    #: every fp32 run from another seed had the reference's losses bit for bit: the model does not depend on
    #: the seed, no noise was measured, and the band is only its floor (every verdict judged on it says so)
    seeds_identical: bool = False

    @property
    def warning(self) -> str | None:
        """What every verdict judged on this band must say (None: nothing)."""
        if not self.seeds_identical:
            return None
        return (
            "the fp32 runs from other seeds had the same losses as seed 0 bit for bit (the model does not depend on "
            "torch.manual_seed: does build_model reseed, or load fixed weights?), so no noise was measured and the "
            f"band is only its floor, {self.rule.floor:.0%} of the loss; make the initialisation follow the seed "
            "for a measured band."
        )

    @property
    def lower(self) -> np.ndarray:
        return self.center - self.width

    @property
    def upper(self) -> np.ndarray:
        return self.center + self.width


def fp32_band(reference: np.ndarray, noise: Sequence[np.ndarray], rule: VerdictRule) -> Band:
    """The band from finite fp32 curves of equal length (the caller checks finiteness)."""
    if not noise:
        raise ValueError("the noise band needs at least one fp32 run from another seed")
    n = min(len(reference), *(len(c) for c in noise))
    r = rule.resolve(n)
    assert r.span is not None
    center = ema(reference[:n], r.span)
    gaps = np.max([np.abs(ema(c[:n], r.span) - center) for c in noise], axis=0)
    noise_gap = rolling_max(gaps, r.span)
    width = np.maximum(r.factor * noise_gap, r.floor * np.abs(center))
    identical = all(np.array_equal(np.asarray(c[:n]), np.asarray(reference[:n])) for c in noise)
    return Band(center, width, noise_gap, r, seeds_identical=identical)


def first_run(mask: np.ndarray, length: int, start: int = 0) -> int | None:
    """Index where ``mask`` first holds for ``length`` consecutive entries at or after ``start``."""
    count = 0
    for i in range(start, len(mask)):
        count = count + 1 if mask[i] else 0
        if count >= length:
            return i - length + 1
    return None


# ---------------------------------------------------------------------------- verdicts


def scale_summary(run: Curves) -> dict[str, Any] | None:
    """The loss-scale history of a run with a scaler (None without one)."""
    if run.loss_scaling == "none" or not len(run.scale):
        return None
    skipped = np.flatnonzero(run.skipped)
    return {
        "initial": float(run.scale[0]),
        "min": float(run.scale.min()),
        "max": float(run.scale.max()),
        "final": float(run.scale[-1]),
        "skipped_steps": int(len(skipped)),
        "first_skipped_step": int(skipped[0]) + 1 if len(skipped) else None,
    }


def judge(candidate: Curves, band: Band) -> Verdict:
    """Apply the band's rule to one candidate run; its ``notes`` lead the message (every report shows them)."""
    v = _judge(candidate, band)
    notes = tuple(getattr(candidate, "notes", ())) + ((band.warning,) if band.warning else ())
    return dataclasses.replace(v, message=" ".join(f"WARNING: {n}" for n in notes) + f" {v.message}") if notes else v


def identical_to_reference(candidate: Curves, reference_loss: np.ndarray, low: str) -> Verdict | None:
    """UNJUDGED when a recipe that should compute in ``low`` precision (``"bf16"``, ``"fp16"``, ``"fp8"``)
    reproduced the fp32 reference's losses bit for bit at every step: nothing of the run computed in
    ``low``, so the comparison tested nothing (a TRACKS would be vacuous). None otherwise."""
    loss = np.asarray(candidate.loss, dtype=np.float64)
    ref = np.asarray(reference_loss, dtype=np.float64)
    if candidate.error is not None or len(loss) != len(ref) or not len(loss) or not np.array_equal(loss, ref):
        return None
    return Verdict(
        candidate.label, candidate.recipe, "UNJUDGED",
        f"its loss equals fp32's bit for bit at all {len(loss)} steps: nothing of this run computed in {low} (does the "
        f"model turn autocast off, or cast its activations and weights to float32 inside forward?), so {candidate.recipe} "
        "was not tested here; let the model's matmuls run under the recipe's autocast, or compare a model that does",
        scale=scale_summary(candidate),
    )


def _judge(candidate: Curves, band: Band) -> Verdict:
    label, recipe = candidate.label, candidate.recipe
    scale = scale_summary(candidate)
    loss = np.asarray(candidate.loss, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(loss))
    if len(bad):
        first = int(bad[0])
        msg = f"loss is {loss[first]} at step {first + 1}"
        if scale is not None:
            scale["at_first_nonfinite"] = float(candidate.scale[first])
            msg += (
                f" (loss scale {scale['at_first_nonfinite']:g} there; scale went from {scale['initial']:g} "
                f"to a minimum of {scale['min']:g}; {scale['skipped_steps']} steps skipped)"
            )
        return Verdict(label, recipe, "NON-FINITE", msg, first_step=first + 1, scale=scale)
    if candidate.error is not None:
        return Verdict(label, recipe, "ERROR", candidate.error, scale=scale)

    n = min(len(loss), len(band.center))
    r = band.rule
    assert r.span is not None and r.patience is not None and r.warmup is not None
    smooth = ema(loss[:n], r.span)
    gap = smooth - band.center[:n]
    ratio = np.abs(gap) / np.maximum(band.width[:n], np.finfo(np.float64).tiny)
    judged = slice(min(r.warmup, n), n)
    if judged.start >= n:
        return Verdict(label, recipe, "UNJUDGED", f"only {n} steps: nothing after the {r.warmup}-step warm-up to judge", scale=scale)
    worst = judged.start + int(np.argmax(ratio[judged]))
    common = dict(gap=float(gap[worst]), ratio=float(ratio[worst]), final_gap=float(gap[n - 1]), scale=scale)
    start = first_run(ratio > 1.0, r.patience, judged.start)
    if start is None:
        msg = (
            f"within the fp32 noise band at every step after {r.warmup} (largest gap {ratio[worst]:.2f} x "
            f"the band at step {worst + 1}); final smoothed loss {smooth[n - 1]:.5g} vs fp32 {band.center[n - 1]:.5g}"
        )
        return Verdict(label, recipe, "TRACKS", msg, **common)
    direction = "above" if gap[worst] > 0 else "below"
    msg = (
        f"leaves the fp32 noise band at step {start + 1} for {r.patience}+ steps; at worst {abs(gap[worst]):.3g} "
        f"{direction} fp32 at step {worst + 1}, {ratio[worst]:.1f} x the band"
    )
    return Verdict(label, recipe, "DIVERGES", msg, first_step=start + 1, **common)
