"""What goes into a training step and what comes out: the checks ``MixedPrecision`` makes at its
doors (optimizers, schedulers, the clip norm, a state dict), so a mistake is one clear error before
any work, and ``StepStats``, what one ``step`` did."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

import torch


@dataclasses.dataclass
class StepStats:
    """What one call to ``MixedPrecision.step`` did. Tensors stay on the device: reading them
    (``float(stats.loss)``, ``stats.to_dict()``) is a host sync, and yours to choose.

    Attributes:
        loss: the unscaled fp32 loss (at an accumulation boundary: the mean over the window).
        grad_norm: total gradient norm before clipping (None unless clipping or ``track_grad_norm``).
        scale: the loss scale this step's backward used (1.0 without a scaler).
        skipped: 0-d bool; True when the optimizer step was attempted and skipped for inf/NaN
            gradients (parameters and optimizer state left as they were).
        stepped: whether an optimizer step was *attempted* at this call: False for an accumulation
            micro-step. So ``stepped=True, skipped=True`` is a step that was due and skipped; the
            update was applied when ``stepped and not skipped``.
        step: optimizer steps attempted so far, skipped ones included.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    scale: torch.Tensor
    skipped: torch.Tensor
    stepped: bool
    step: int

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (one sync per tensor field)."""
        return {
            "loss": float(self.loss),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "scale": float(self.scale),
            "skipped": bool(self.skipped),
            "stepped": self.stepped,
            "step": self.step,
        }


Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


def _as_optimizers(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizers is None or not isinstance(optimizers, (torch.optim.Optimizer, list, tuple)):
        raise TypeError(f"step() expects torch.optim.Optimizer instances (the optimizer to step, or a list of "
                        f"them), got {type(optimizers).__name__}")
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not opts:
        raise ValueError("step() needs at least one optimizer")
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"step() expects torch.optim.Optimizer instances, got {type(o).__name__}")
    return opts


_MP_KEYS = {"recipe", "scaler", "steps", "masters", "fp8", "parallel"}


def _check_mp_state(state: Any) -> None:
    """Refuse what is not a ``MixedPrecision.state_dict()``, saying what it is and where it goes."""
    shape = "{'recipe': name, 'scaler': {...}, 'steps': n[, 'masters': {...}]}"
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects the dict mp.state_dict() returned ({shape}), got {type(state).__name__}")
    if {"scale", "growth_factor", "_growth_tracker"} <= set(state):
        raise ValueError("this is a loss scaler's state dict (torch.amp.GradScaler or mixprec.GradScaler), not a "
                         f"MixedPrecision one: load it with mp.scaler.load_state_dict(state). mp.state_dict() is {shape}")
    unknown = set(state) - _MP_KEYS
    if "recipe" not in state or "scaler" not in state or unknown:
        raise ValueError(f"not a MixedPrecision state dict (keys {sorted(state)[:6]}"
                         f"{', unknown: ' + str(sorted(unknown)[:6]) if unknown else ''}); mp.state_dict() is {shape}. "
                         "Save mp.state_dict() beside the model's and the optimizer's and load that")


def _check_schedulers(scheduler: Any) -> None:
    for s in scheduler if isinstance(scheduler, (list, tuple)) else (scheduler,):
        if s is not None and not callable(getattr(s, "step", None)):
            raise TypeError(f"scheduler must be an lr scheduler (an object with .step(), e.g. "
                            f"torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max)) or a list of them; got "
                            f"{type(s).__name__} {s!r}"[:200])


def _check_max_grad_norm(max_grad_norm: float | None) -> None:
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_grad_norm!r}: a norm "
                         "of 0 would zero every update, a negative one would reverse it")
