"""fp8 cast probe: what each cast of an fp8 model's linears does to its tensor, at its current scale.

    model = mp.prepare(model)                      # an fp8 recipe
    for c in probe_fp8_casts(model, lambda: loss_fn(model(x), y), autocast=mp.autocast):
        print(c.describe())    # blocks.0.fc grad_output (e5m2, scale ...): 0.02% flushed to 0, 0% saturated, SQNR 25 dB

One forward and backward; per fp8 layer and tensor (input, weight, grad_output), a
``mixprec.fp8.CastStats``: the fraction of nonzero values the cast flushed to zero, the fraction it
saturated, and its SQNR against the unquantized tensor. The model's gradients and its delayed-scaling
state are put back afterwards. ``probe_grad_underflow`` reports the same for fp8 models
(``report.fp8``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from mixprec.diagnostics.probes._common import GradSnapshot, check_args, run_backward
from mixprec.fp8 import CastObserver, CastStats, fp8_layers, preserve_scaling_state

#: the gates doctor applies (torchao's numerics tests ask 25 dB of a cast, 20 dB of a linear's output
#: and gradients); below ``ALARM_DB`` most of a tensor is lost, as with an unscaled e4m3 gradient
WARN_DB, ALARM_DB = 20.0, 10.0
#: a flushed population, judged apart from SQNR (a healthy fp8-current or fp8-delayed cast flushes 0%;
#: after a spike a delayed input scale 2660x too small flushed 1.5-1.9% each step at 31 dB SQNR; an
#: unscaled e4m3 gradient flushes 99%): ``CastStats.flushed_fraction`` at or past these
FLUSH_WARN, FLUSH_ALARM = 1e-3, 1e-2


def probe_fp8_casts(model: nn.Module, closure: Callable[[], torch.Tensor],
                    autocast: Callable[[], contextlib.AbstractContextManager] | None = None) -> list[CastStats]:
    """Run ``closure`` (forward and loss; under ``autocast()`` when given) and one backward, and
    return the statistics of every fp8 cast (empty for a model without fp8 layers)."""
    check_args("probe_fp8_casts", model, closure)
    if not fp8_layers(model):
        return []
    snap = GradSnapshot([p for p in model.parameters() if p.requires_grad])
    snap.clear()
    try:
        with CastObserver(model) as obs, preserve_scaling_state(model):
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = closure()
            run_backward(lambda: loss, "probe_fp8_casts")
            return obs.read()
    finally:
        snap.restore()


def worst(stats: list[CastStats], n: int = 5) -> list[CastStats]:
    """The ``n`` casts with the lowest SQNR (NaN first: a NaN never passes)."""
    return sorted(stats, key=lambda c: (c.sqnr_db == c.sqnr_db, c.sqnr_db))[:n]


def status(c: CastStats) -> str:
    """``"alarm"``, ``"warn"`` or ``"ok"`` for one cast: its SQNR against ``ALARM_DB`` / ``WARN_DB``, its
    flushed population against ``FLUSH_ALARM`` / ``FLUSH_WARN`` (whatever the SQNR), any saturation a warning."""
    if not c.sqnr_db >= ALARM_DB or c.flushed_fraction >= FLUSH_ALARM:  # (a NaN SQNR is an alarm)
        return "alarm"
    if c.sqnr_db < WARN_DB or c.flushed_fraction >= FLUSH_WARN or c.saturated:
        return "warn"
    return "ok"


def flushing(stats: list[CastStats], threshold: float = FLUSH_WARN) -> list[CastStats]:
    """The casts that flush at least ``threshold`` of their nonzero values to zero, most first."""
    return sorted((c for c in stats if c.flushed_fraction >= threshold), key=lambda c: -c.flushed_fraction)
