"""The runs ``doctor`` bases its findings on: a few steps of a task under a recipe, watched.

``run_steps`` trains a fresh model (seeded) for a few steps with ``MixedPrecision``, inside a NaN
guard in record mode and a scale monitor, and keeps what the checks need: losses, the guard's
events, gradient norms, the scaler's record, which parameters' gradients were exactly zero on the
first step, the dtype the loss came out in, and which modules returned a scalar (a loss computed
inside the model).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.events import NonFiniteEvent
from mixprec.diagnostics.guard import nan_guard
from mixprec.diagnostics.scale_monitor import Overflow, ScaleDiagnosis, ScaleMonitor, diagnose_scale
from mixprec.policy import PreparedForward
from mixprec.tasks import Task, to_device
from mixprec.training import MixedPrecision


@dataclasses.dataclass
class RunResult:
    """What one watched run saw.

    Attributes:
        recipe: the recipe's canonical name; scale: the loss scale of the first step.
        losses: per step (NaN/inf kept); grad_norms: per step, before clipping.
        events: the guard's events (at most one per pass), oldest first.
        history, diagnosis, overflows: the scaler's record, its diagnosis, and attributed overflows.
        zero_grads: parameter name -> fraction of its first-step gradient that was exactly 0.
        loss_dtype: dtype of ``task.loss_fn``'s result under the recipe.
        scalar_modules: (module name, class, dtype) of modules that returned a scalar on step 0.
        error: an exception that stopped the run (text), or None.
    """

    recipe: str
    scale: float
    losses: list[float] = dataclasses.field(default_factory=list)
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)
    events: list[NonFiniteEvent] = dataclasses.field(default_factory=list)
    history: dict[str, list] | None = None
    diagnosis: ScaleDiagnosis | None = None
    overflows: list[Overflow] = dataclasses.field(default_factory=list)
    zero_grads: dict[str, float] = dataclasses.field(default_factory=dict)
    loss_dtype: torch.dtype | None = None
    scalar_modules: list[tuple[str, str, torch.dtype]] = dataclasses.field(default_factory=list)
    error: str | None = None
    error_at: str | None = None  # where the task's own code raised it ("file:line in function"), when it did
    seconds: float = 0.0
    skipped: list[bool] = dataclasses.field(default_factory=list)  # per step: the scaler skipped it
    settle_steps: int = 0  # steps run past ``steps`` until the loss scale had settled (see run_steps)
    # the model and its MixedPrecision after the last step: the state the recipe trains in, for probes
    model: Any = dataclasses.field(default=None, repr=False, compare=False)
    mp: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def train_scale(self) -> float:
        """The loss scale of the first step the scaler took (after its initial back-off), else the first."""
        taken = [i for i, s in enumerate(self.skipped) if not s]
        scales = (self.history or {}).get("scale") or []
        return float(scales[taken[0]]) if taken and taken[0] < len(scales) else self.scale

    @property
    def finite(self) -> bool:
        return self.error is None and all(math.isfinite(v) for v in self.losses)

    @property
    def faults(self) -> list[NonFiniteEvent]:
        """Events that are faults: everything but the scaler's own backward overflows."""
        return [e for e in self.events if not e.scaled]

    @property
    def faulty(self) -> bool:
        return not self.finite or bool(self.faults)

    @property
    def root_faults(self) -> list[NonFiniteEvent]:
        """The faults that are causes: once the forward made a non-finite value (an op produced it, or
        was handed NaN as a number), the backward events that follow are its consequences (a NaN
        loss's gradient through log_softmax is not a log of 0)."""
        f = self.faults
        made = [e for e in f if e.phase == "forward" and e.origin in ("producer", "constant")]
        return [e for e in f if e.phase == "forward"] if made else f

    @property
    def first_fault(self) -> NonFiniteEvent | None:
        f = self.root_faults
        fwd = [e for e in f if e.phase == "forward" and e.origin in ("producer", "constant")]
        return (fwd or [e for e in f if e.origin == "producer"] or f or [None])[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "scale": self.scale, "losses": self.losses, "grad_norms": self.grad_norms,
            "events": [e.to_dict() for e in self.events], "error": self.error, "seconds": round(self.seconds, 3),
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_dict(),
            "overflows": [dataclasses.asdict(o) for o in self.overflows],
            "loss_dtype": None if self.loss_dtype is None else str(self.loss_dtype).removeprefix("torch."),
            "skipped": self.skipped, "settle_steps": self.settle_steps, "train_scale": self.train_scale,
        }


def build(task: Task, recipe: str, device: torch.device, seed: int, **mp_kwargs: Any) -> tuple[nn.Module, MixedPrecision]:
    """A fresh seeded model, prepared for ``recipe``."""
    torch.manual_seed(seed)
    model = task.build_model().to(device)
    mp = MixedPrecision(recipe, device, **mp_kwargs)
    mp.prepare(model)
    return model, mp


class _Watcher:
    """A removable watch on a prepared model's own output (``PreparedForward.watchers``)."""

    def __init__(self, prepared: PreparedForward, fn: Any) -> None:
        self.prepared, self.fn = prepared, fn
        prepared.watchers.append(fn)

    def remove(self) -> None:
        if self.fn in self.prepared.watchers:
            self.prepared.watchers.remove(self.fn)


def _scalar_watch(model: nn.Module, out: list[tuple[str, str, torch.dtype]]) -> list[Any]:
    def hook(name: str, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel() == 1:
            out.append((name, type(module).__name__, output.dtype))

    handles: list[Any] = []
    for n, m in model.named_modules():
        prepared = m.__dict__.get("forward")
        if isinstance(prepared, PreparedForward):  # the model's own output, before the recipe's output cast
            handles.append(_Watcher(prepared, lambda o, n=n, m=m: hook(n, m, (), o)))
        else:
            handles.append(m.register_forward_hook(lambda mod, a, o, n=n: hook(n, mod, a, o), prepend=True))
    return handles


def _zero_watch(model: nn.Module, out: dict[str, float]) -> list[Any]:
    def hook(name: str, p: torch.Tensor) -> None:
        if name not in out and p.grad is not None:
            out[name] = float((p.grad == 0).float().mean())

    return [p.register_post_accumulate_grad_hook(lambda p, n=n: hook(n, p))
            for n, p in model.named_parameters() if p.requires_grad]


def _unsettled(result: RunResult) -> bool:
    """The scaler skipped every step so far while the forward and the loss were finite: it is still
    backing off from its initial scale (the routine first overflows of fp16), not yet training."""
    return bool(result.skipped) and all(result.skipped) and result.finite and not result.faults


def _task_frame(e: BaseException) -> str | None:
    """The innermost frame of ``e``'s traceback in the task's own code (not torch's, not mixprec's), as
    ``file:line in function``; None when the task's code is not on it (mixprec refused what it returned)."""
    import traceback
    from pathlib import Path

    import mixprec

    libs = tuple(str(Path(m.__file__).parent) for m in (torch, mixprec) if m.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(libs)
              and not f.filename.startswith("<")]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None


def run_steps(task: Task, recipe: str, device: torch.device, *, steps: int, seed: int = 0,
              settle: int = 0) -> RunResult:
    """Train ``steps`` steps of ``task`` under ``recipe``, watched. Never raises for the model's faults.

    ``settle``: with a loss scaler, up to this many more steps while every step so far was skipped
    for a backward overflow alone (the scale halving from its initial value), so that the run
    reaches the state the recipe trains in; ``settle_steps`` says how many it took."""
    t0 = time.perf_counter()
    model, mp = build(task, recipe, device, seed, track_grad_norm=True)
    scaler = mp.scaler
    result = RunResult(mp.recipe.name, float(scaler.get_scale()) if scaler.is_enabled() else 1.0)
    opt = task.build_optimizer(mp.parameters(model))  # fp32 masters for the -true recipes
    handles = _scalar_watch(model, result.scalar_modules) + _zero_watch(model, result.zero_grads)
    monitor = ScaleMonitor(scaler, model).attach() if scaler.is_enabled() else None
    try:
        with nan_guard(model, "record", scaler=scaler) as guard:
            step = 0
            while step < steps or (step < steps + settle and _unsettled(result)):
                inputs, targets = to_device(task.get_batch(step), device)
                with mp.autocast():
                    out = task.run_forward(model, inputs)
                    loss = task.loss_fn(out, targets)
                if step == 0:
                    for h in handles[: len(list(model.modules()))]:
                        h.remove()  # the scalar watch is for step 0 only
                    result.loss_dtype = loss.dtype if isinstance(loss, torch.Tensor) else None
                stats = mp.step(loss, opt, max_grad_norm=task.max_grad_norm)
                value = float(stats.loss)
                result.losses.append(value)
                result.grad_norms.append(None if stats.grad_norm is None else float(stats.grad_norm))
                result.skipped.append(bool(stats.skipped))
                result.events = list(guard.events)
                step += 1
                if not math.isfinite(value) and not scaler.is_enabled():
                    break  # without a scaler the step was taken: every later step starts from NaN weights
            result.settle_steps = max(0, step - steps)
        result.events = list(guard.events)
        result.model, result.mp = model, mp
    except Exception as e:  # the user's model may fail in any way; doctor reports it
        result.error = f"{type(e).__name__}: {e}"
        result.error_at = _task_frame(e)
        result.events = list(guard.events) if "guard" in locals() else []
    finally:
        for h in handles:
            h.remove()
        if monitor is not None:
            monitor.detach()
            result.history = {k: v.tolist() for k, v in scaler.history().items()}
            result.diagnosis = diagnose_scale(result.history)
            result.overflows = monitor.overflows()
        result.seconds = time.perf_counter() - t0
    return result
