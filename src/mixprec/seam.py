"""The seam between ``MixedPrecision`` and a parallel strategy (``mixprec.distributed``: DDP, FSDP2).

``MixedPrecision.prepare(model, parallel=...)`` hands the strategy a ``Local``: what the recipe is on
one process and how to apply it. The strategy checks, agrees with the other ranks, applies the
recipe through ``Local.apply`` and wraps the model; it returns a ``Plugged``. From then on the facade
calls the strategy (``mp._dist``) at the fixed points of the step listed in ``Strategy``, and
nowhere else. The strategy never touches the facade: it sees what it is handed.

On one process ``mp._dist`` is None and none of this runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Local:
    """What a strategy is given at prepare.

    ``apply(model, check_params=..., masters=...)`` applies the recipe on this process as
    ``prepare(model)`` does (``masters=False``: without the facade's master weights, for a strategy
    whose shards are the masters). ``masters`` is the facade's master-weight strategy (None when
    the recipe stores fp32 parameters); ``parallel`` tells whether this facade already trains a
    distributed model; ``fp8_spec`` / ``fp8_state()`` what an fp8 recipe swaps in and, after ``apply``,
    the state of its fp8 layers.
    """

    recipe: Any
    device: torch.device
    scaler: Any
    accumulate: int
    fp32_modules: Sequence[Any]
    masters: Any
    apply: Callable[..., nn.Module]
    parallel: bool
    fp8_spec: Any = None  # an fp8 recipe's Fp8Spec (the ranks agree on it), else None
    fp8_state: Callable[[], Any] = lambda: None  # after apply: the fp8 layers' state (mixprec.fp8.Fp8Training) or None


@dataclasses.dataclass(frozen=True)
class Plugged:
    """What a strategy gives back: the model to train, itself, and the masters the facade keeps."""

    model: nn.Module
    strategy: Strategy
    masters: Any


class Strategy(Protocol):
    """The points at which ``MixedPrecision`` calls a parallel strategy (each a collective where
    it says so: every rank calls it at the same point of the same step)."""

    def local_module(self, model: nn.Module) -> nn.Module:
        """The module the recipe was applied to (inside a DDP wrapper), for ``mp.parameters``."""

    def backward(self, loss: torch.Tensor, *, boundary: bool, accumulating: bool, retain_graph: bool) -> None:
        """``loss.backward()``; gradients communicated at the accumulation boundary only."""

    def reduce_master_grads(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """At the boundary: average fp32 master gradients over the ranks (a collective)."""

    def share_skip_decision(self, scaler: Any, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
        """After unscaling: one skip decision for every rank, and the check that every rank is at
        the same step with the same window (a collective; raises on every rank alike)."""

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None, norm_type: float) -> torch.Tensor:
        """The norm over every rank's gradients, clipping by it (a collective)."""

    def discard(self, steps: int) -> int:
        """``mp.reset()`` was called (by ``step`` when it raised, or by the user): this rank's window is
        gone. The strategy decides what that means for the others (docs/distributed.md), and returns
        the micro-step the facade's window goes on from."""

    def stepped(self) -> None:
        """The optimizer step (or skip), the scheduler and what follows them finished on this rank."""

    def loaded(self) -> None:
        """``mp.load_state_dict`` ran on this rank (every rank loads the same checkpoint)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of the layout (``mp.state_dict()["parallel"]``)."""

    def describe(self) -> str:
        """One line for ``mp.describe()``."""
