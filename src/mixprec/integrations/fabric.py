"""A Lightning Fabric precision plugin running a mixprec recipe: the loop stays yours.

    import lightning as L
    from mixprec.integrations.fabric import MixprecFabricPrecision

    precision = MixprecFabricPrecision("fp16-mixed", device="cpu", scaler={"hysteresis": 2})
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = precision.skip_aware(scheduler)          # a skipped step does not advance it
    for x, y in batches:
        with fabric.autocast():                          # or call the model Fabric returned
            loss = loss_fn(model(x), y)
        fabric.backward(loss)                            # the loss scaled by mixprec's scaler
        fabric.clip_gradients(model, optimizer, max_norm=1.0)   # on the unscaled gradients
        optimizer.step()                                 # step or skip, scale update, write-back
        optimizer.zero_grad()
        scheduler.step()

``MixprecFabricPrecision(recipe, **options)`` takes what ``MixedPrecision`` takes (``scaler=``,
``fp32_modules=``, ``fp32_params=``, ``track_grad_norm=``, ``skip_nonfinite=``, ``nan_guard=``).
At Fabric's hooks it does what ``mp.step`` does in a hand-written loop, in the same order:

- ``convert_module`` (``fabric.setup``): ``mp.prepare`` (fp32 islands, the output cast, 16-bit
  storage and masters);
- ``forward_context`` (the model Fabric returns, ``fabric.autocast()``): ``mp.autocast()``;
- ``backward`` (``fabric.backward``): the loss scaled by mixprec's scaler;
- ``unscale_gradients`` (``fabric.clip_gradients``): the window's end, unscale and the inf
  check, once per step; on a step the scaler will skip, the gradients are zeroed, so that
  Fabric's clip (``error_if_nonfinite=True`` by default) does not raise on the routine overflow;
- ``optimizer_step`` (``optimizer.step()``): step or skip, scale update, write-back; its
  ``StepStats`` is ``precision.last_stats``.

Several ``fabric.backward`` calls before ``optimizer.step()`` are one accumulation window.
Fabric's own ``precision="16-mixed"`` on a CPU trains in bf16; this plugin runs the recipe that
was asked for, or refuses.

16-bit storage recipes (``bf16-true`` and its variants, ``fp16-true``): the optimizer built over
``model.parameters()`` is moved onto the fp32 masters at its first step. If a window has more
than one ``fabric.backward`` before that first step, call ``precision.connect(optimizer)`` after
``fabric.setup``, so that each backward's 16-bit gradients are added to the masters in fp32. For
these recipes ``fabric.clip_gradients`` cannot work: Fabric clips ``main_params`` with torch,
while some gradients are still 16-bit and waiting for their bucket. Use
``precision.clip_grad_norm_(optimizer, max_norm)`` instead.

Checkpoints: put the plugin in Fabric's state, ``fabric.save(path, {"model": model,
"optimizer": optimizer, "mixprec": precision})``, and ``fabric.load(path, state)`` restores it.
Resume is then bitwise; saving inside an accumulation window is refused (its gradients are not
saved). With a 16-bit storage recipe, call ``precision.connect(optimizer)``
before ``fabric.load``: the saved optimizer state belongs to the fp32 masters.

One device only (Fabric's default single-device strategy): for DDP or FSDP2 use
``mp.prepare(model, parallel=...)`` in a hand-written loop (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

try:
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
except ImportError as e:  # the extra is not installed
    raise ImportError(f"mixprec.integrations.fabric needs lightning ({e}): pip install \"mixprec[lightning]\"") from e

from mixprec.integrations._common import SkipAwareScheduler, rebind_to_masters
from mixprec.integrations._common import check_version as _check_version
from mixprec.integrations.lightning import TESTED, lightning_precision_name
from mixprec.recipes import Recipe
from mixprec.training import MixedPrecision, StepStats


class MixprecFabricPrecision(FabricPrecision):
    """Lightning Fabric precision plugin for a mixprec recipe (see the module's docstring).

    Args:
        recipe: a mixprec recipe name, a jmp policy string or a ``Recipe``; ``"auto"`` is
            resolved for ``device``.
        device: the device Fabric runs on (its accelerator): ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
            None: CUDA when available, else the CPU (Fabric's ``accelerator="auto"``).
        check_version: refuse a lightning release outside the tested range (False: try it anyway).
        **options: ``MixedPrecision`` keyword arguments (not ``accumulate``: the window is the
            backwards between two ``optimizer.step()`` calls).

    Attributes: ``mp`` (the ``MixedPrecision``), ``last_stats`` (the last step's ``StepStats``).
    """

    def __init__(self, recipe: str | Recipe = "auto", *, device: str | torch.device | None = None,
                 check_version: bool = True, **options: Any) -> None:
        _check_version("lightning", *TESTED, extra="lightning", check=check_version)
        if "accumulate" in options:
            raise ValueError(
                "MixprecFabricPrecision takes no accumulate=: in a Fabric loop the window is the "
                "fabric.backward calls before each optimizer.step(). Call optimizer.step() every "
                f"{options['accumulate']!r} backwards instead."
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.mp = MixedPrecision(recipe, device, **options)  # refuses bad arguments now
        self.precision = lightning_precision_name(self.mp.recipe)  # type: ignore[assignment]
        self.last_stats: StepStats | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._loss_sum: torch.Tensor | None = None
        self._backwards = 0  # in the current window
        self._ready = False  # the window is closed and its gradients unscaled
        self._grad_norm: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"MixprecFabricPrecision({self.mp.recipe.name!r}, device={str(self.mp.device)!r})"

    # ------------------------------------------------------------------ setup

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.mp.prepare(module.to(self.mp.device))

    def connect(self, *optimizers: Any) -> None:
        """Tell the plugin its optimizers before their first step (16-bit storage recipes whose
        first window has several backwards); otherwise each is taken at its first step."""
        for opt in optimizers:
            self._adopt(_unwrap(opt))

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        if any(o is optimizer for o in self._optimizers):
            return
        if self.mp.masters is not None and self._optimizers:
            raise ValueError(
                f"recipe {self.mp.recipe.name!r} stores parameters in 16 bits with one set of fp32 masters, "
                "and this is a second optimizer. Use one optimizer with parameter groups, or a recipe "
                "that stores parameters in fp32 (bf16-mixed, fp16-mixed)."
            )
        try:
            rebind_to_masters(self.mp, [optimizer])
        except ValueError as e:
            raise ValueError(f"{e} With Fabric: call precision.connect(optimizer) right after fabric.setup, "
                             "before fabric.load (a checkpoint's optimizer state belongs to the masters).") from None
        self._optimizers.append(optimizer)

    def skip_aware(self, scheduler: Any) -> SkipAwareScheduler:
        """``scheduler`` wrapped so that its ``step()`` does nothing after a skipped optimizer step."""
        return scheduler if isinstance(scheduler, SkipAwareScheduler) else SkipAwareScheduler(scheduler, self.mp)

    # ------------------------------------------------------------------ forward and backward

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.mp.autocast()

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self.mp.masters is not None and not self._optimizers and self._backwards:
            raise RuntimeError(
                f"recipe {self.mp.recipe.name!r} (16-bit storage) adds each backward's 16-bit gradients to "
                "the fp32 masters, and this window's optimizer is not known yet: call "
                "precision.connect(optimizer) after fabric.setup, before the first backward."
            )
        loss = tensor.float() if tensor.dtype != torch.float32 else tensor
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self.mp.scaler.scale(loss).backward(*args, **kwargs)
        self._backwards += 1
        self._ready = False
        if self._optimizers:
            self.mp.after_backward(self._optimizers, boundary=False)

    # ------------------------------------------------------------------ the step

    def _prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The end of the window and unscale, once per step."""
        if self._ready:
            return
        if not self._backwards:
            raise RuntimeError("optimizer.step() without a fabric.backward() in this window: nothing to step")
        self._adopt(optimizer)
        self.mp.after_backward([optimizer], boundary=True)
        self.mp.unscale_([optimizer])
        self._ready, self._grad_norm = True, None

    def unscale_gradients(self, optimizer: Any) -> None:
        """``fabric.clip_gradients``: unscale, then (with a loss scaler) make a step the scaler will
        skip clip without raising. Fabric runs torch's clip next with ``error_if_nonfinite=True``
        (its default), which raised on the routine overflow; so the gradients of a step whose inf
        check failed are zeroed on the device (no host sync; the step is skipped whatever they hold)
        and Fabric returns a norm of 0 for it. ``precision.last_stats`` keeps the true norm (inf)
        with ``track_grad_norm=True``."""
        optimizer = _unwrap(optimizer)
        self._prepare_step(optimizer)
        scaler = self.mp.scaler
        if not scaler.is_enabled() or self.mp.masters is not None:  # (storage recipes clip with clip_grad_norm_)
            return
        if self.mp.track_grad_norm and self._grad_norm is None:
            self._grad_norm = self.mp.clip_grad_norm_([optimizer], None)  # measured before the zeroing
        found = sum(f.to(scaler._scale.device) for f in scaler._found_inf_per_device(optimizer).values())
        skip = found > 0  # a 0-d bool on the device
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.masked_fill_(skip.to(p.grad.device), 0.0)

    def main_params(self, optimizer: Any) -> Any:
        optimizer = _unwrap(optimizer)
        if self.mp.masters is not None:
            raise ValueError(
                f"fabric.clip_gradients cannot clip under recipe {self.mp.recipe.name!r} (16-bit storage: some "
                "gradients stay 16-bit until their bucket steps, and Fabric clips with torch). Use "
                "precision.clip_grad_norm_(optimizer, max_norm) instead: the same norm clip, on the masters."
            )
        return [p for group in optimizer.param_groups for p in group["params"]]

    def clip_grad_norm_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the window's unscaled (master) gradients to ``max_norm``; their norm before clipping."""
        optimizer = _unwrap(optimizer)
        self._prepare_step(optimizer)
        self._grad_norm = self.mp.clip_grad_norm_([optimizer], float(max_norm), norm_type)
        assert self._grad_norm is not None
        return self._grad_norm

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        optimizer = _unwrap(optimizer)
        if isinstance(optimizer, torch.optim.LBFGS) or "closure" in kwargs:
            raise ValueError("MixprecFabricPrecision cannot run a closure optimizer (LBFGS): it re-runs backward "
                             "inside step, where a loss scaler cannot unscale or skip.")
        if kwargs:
            raise ValueError(f"MixprecFabricPrecision passes no extra arguments to optimizer.step; got {sorted(kwargs)}")
        self._prepare_step(optimizer)
        grad_norm = self._grad_norm
        if grad_norm is None and self.mp.track_grad_norm:
            grad_norm = self.mp.clip_grad_norm_([optimizer], None)
        loss, self._loss_sum = self._loss_sum, None
        self.last_stats = self.mp.optimizer_step([optimizer], loss=loss, grad_norm=grad_norm)
        self._ready, self._grad_norm, self._backwards = False, None, 0
        return None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        if self._backwards:  # (as mp.state_dict() refuses inside its own window)
            raise RuntimeError(
                f"fabric.save inside an accumulation window ({self._backwards} fabric.backward call(s) since the last "
                "optimizer.step()): the gradients accumulated so far live in .grad (and, for 16-bit storage, on the "
                "fp32 masters) and are not saved, so a resumed run would start this window over and diverge. "
                "Save after optimizer.step().")
        return self.mp.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("recipe") if isinstance(state_dict, dict) else None
        if saved is not None and saved != self.mp.recipe.name:
            raise ValueError(
                f"fabric.load: this checkpoint's mixprec state is of a run of recipe {saved!r}, and this plugin runs "
                f"{self.mp.recipe.name!r}: its loss scaler and masters belong to {saved!r}. Resume with "
                f"MixprecFabricPrecision({saved!r}), or start a new run from its weights: "
                "fabric.load(path, {\"model\": model}, strict=False)."
            )
        self.mp.load_state_dict(state_dict)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer behind Fabric's wrapper (the one the scaler and the masters know)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
