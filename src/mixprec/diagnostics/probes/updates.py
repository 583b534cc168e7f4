"""Update-vanishing probe: which parameters need fp32 master weights?

After one real optimizer step (in fp32), for each parameter: the fraction of its elements whose
update ``dw`` would be lost if the weight were stored in bf16 or fp16, i.e. where
``round(w16 + dw) == w16`` with ``w16`` the weight rounded to that format. In bf16 that happens
whenever |dw| < |w| * 2^-9 (half the gap between neighbours): a typical weight of 0.1 and an Adam
update of 1e-5 is lost entirely. Training goes on, nothing is NaN, the weights do not move.

The sum ``w16 + dw`` is formed in float64 (exact for these operands) and rounded once, which is
what a 16-bit weight updated from an fp32 update computes. The tests compare it with a real
16-bit ``add_``.

    report = probe_update_vanishing(model, opt, lambda: F.cross_entropy(model(x), y))
    report.needs_master("bf16")  # names of parameters that lose more than 10% of their updates
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.probes._common import GradSnapshot, check_args, run_backward
from mixprec.formats import get_format


@dataclasses.dataclass(frozen=True)
class ParamUpdate:
    """One parameter's step.

    Attributes:
        name, numel: the parameter.
        updated: elements the fp32 step changed.
        vanished: format name -> fraction of the updated elements whose update that format loses.
        relative_update: median of |dw| / |w| over updated elements with w != 0.
        decay_only: fraction of the updated elements whose gradient was 0 this step: weight decay
            alone moved them (an embedding's rows for tokens not in the batch), a tiny relative
            update that 16-bit storage loses first.
    """

    name: str
    numel: int
    updated: int
    vanished: dict[str, float]
    relative_update: float
    decay_only: float = 0.0


@dataclasses.dataclass
class UpdateVanishingReport:
    params: list[ParamUpdate]
    formats: tuple[str, ...]
    threshold: float

    def needs_master(self, fmt: str = "bf16", threshold: float | None = None) -> list[str]:
        """Parameters losing more than ``threshold`` (default the report's) of their updates in ``fmt``."""
        name = get_format(fmt).name
        t = self.threshold if threshold is None else threshold
        return [p.name for p in self.params if p.vanished.get(name, 0.0) > t]

    def overall(self, fmt: str = "bf16") -> float:
        """Fraction of all updated elements whose update ``fmt`` loses."""
        name = get_format(fmt).name
        upd = sum(p.updated for p in self.params)
        return sum(p.vanished[name] * p.updated for p in self.params) / upd if upd else 0.0

    def worst(self, fmt: str = "bf16", n: int = 10) -> list[ParamUpdate]:
        name = get_format(fmt).name
        return sorted(self.params, key=lambda p: -p.vanished[name])[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "overall": {f: self.overall(f) for f in self.formats},
            "needs_master": {f: self.needs_master(f) for f in self.formats},
            "params": [dataclasses.asdict(p) for p in self.params],
        }


def vanished_fraction(w: torch.Tensor, dw: torch.Tensor, fmt: str) -> tuple[float, int]:
    """(fraction of the nonzero ``dw`` that rounding ``w`` to ``fmt`` and adding loses, their count)."""
    dtype = get_format(fmt).dtype
    w_lp = w.to(dtype)
    moved = dw != 0
    n = int(moved.sum())
    if n == 0:
        return 0.0, 0
    new = (w_lp.double() + dw.double()).to(dtype)
    return int(((new == w_lp) & moved).sum()) / n, n


def probe_update_vanishing(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], torch.Tensor],
    *,
    formats: Sequence[str] = ("bf16", "f16"),
    threshold: float = 0.1,
    restore: bool = True,
) -> UpdateVanishingReport:
    """Take one real optimizer step on ``closure``'s loss (fp32) and measure what 16-bit weights would lose.

    Args:
        model, optimizer: the optimizer must hold the model's parameters.
        closure: returns the scalar loss.
        formats: storage formats to test.
        threshold: ``needs_master`` lists parameters losing more than this fraction of their updates.
        restore: put the weights, the optimizer state and ``.grad`` back afterwards (default), so
            the probe leaves training untouched; False keeps the step.
    """
    check_args("probe_update_vanishing", model, closure, optimizer)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not any(id(p) in held for _, p in named):
        raise ValueError("probe_update_vanishing: the optimizer holds none of the model's parameters")
    before = {id(p): p.detach().clone() for _, p in named}
    opt_state = copy.deepcopy(optimizer.state_dict()) if restore else None
    snap = GradSnapshot([p for _, p in named])
    snap.clear()
    try:
        run_backward(closure, "probe_update_vanishing")
        no_grad = {id(p): (p.grad == 0) if p.grad is not None else None for _, p in named}  # None: no gradient at all
        optimizer.step()
        names = tuple(get_format(f).name for f in formats)
        out = []
        with torch.no_grad():
            for name, p in named:
                w0 = before[id(p)]
                dw = p.detach().double() - w0.double()  # exact: both are fp32 values
                vanished = {}
                updated = 0
                for f in names:
                    vanished[f], updated = vanished_fraction(w0, dw, f)
                moved = (dw != 0) & (w0 != 0)
                rel = float((dw[moved].abs() / w0.double()[moved].abs()).median()) if bool(moved.any()) else 0.0
                zero = no_grad[id(p)]
                nz = dw != 0
                decay = (1.0 if bool(nz.any()) else 0.0) if zero is None else (
                    float((zero & nz).sum()) / max(int(nz.sum()), 1))
                out.append(ParamUpdate(name, p.numel(), updated, vanished, rel, decay))
    finally:
        if restore:
            with torch.no_grad():
                for _, p in named:
                    p.copy_(before[id(p)])
            optimizer.load_state_dict(opt_state)  # type: ignore[arg-type]
            snap.restore()
        else:
            optimizer.zero_grad(set_to_none=True)
    return UpdateVanishingReport(out, names, threshold)
