"""The per-optimizer state machine of ``torch.amp.GradScaler``: READY -> UNSCALED -> STEPPED.

Holds ``_Stage``, the per-optimizer state (``_fresh_optimizer_state``: the stage, one found-inf
tensor per device, and the host's skip decision of an unfused step), the gradient kernels
(``_check_and_unscale_``), and ``_OptimizerStages``, the ``GradScaler`` mixin with everything that
happens per optimizer between ``scale()`` and ``update()``: ``unscale_``, ``unscale_deferred_``,
``share_skip_decision``, ``step`` (unfused: the host decides; fused: the optimizer skips on the
device, except for the optimizers ``_fused_skip_unsafe`` names), and torch's private hooks
``_check_inf_per_device`` / ``_found_inf_per_device``. ``update()`` (``mixprec.scaling.scaler``)
consumes the found-inf tensors and starts every optimizer afresh.

Relies on ``GradScaler``'s ``_enabled``, ``_scale``, ``_allow_fp16_grads``,
``_per_optimizer_states`` (a defaultdict of ``_fresh_optimizer_state``), ``_get_scale_async()`` and
``_check_scale_growth_tracker()``.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState


# torch's own enum and keys: code written against torch.amp.GradScaler's internals (a helper that
# unscales gradients itself and marks the optimizer UNSCALED) keeps working on this scaler
_Stage = OptState


def _fresh_optimizer_state() -> dict[str, Any]:
    """torch's per-optimizer state (``stage``, ``found_inf_per_device``); mixprec adds
    ``host_found_inf`` when an unfused step has read it, and reads it with ``.get``."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _fused_skip_unsafe(optimizer: torch.optim.Optimizer) -> bool:
    """Fused optimizers whose on-device skip is known to touch state it must leave alone.

    torch's fused SGD with momentum, when the *first* step is one its ``found_inf`` says to skip,
    allocates the momentum buffer without initialising it (seen on torch 2.13 CPU: NaN, 3.4e38;
    reported on 2.11 CUDA, LibreYOLO PR #771), and the next real step reads it; a later skipped
    step leaves the buffer alone. Such optimizers take the unfused path:
    the host decides, and a skipped step never calls ``optimizer.step()``. That costs the sync the
    fused path avoids, and departs from torch's GradScaler, which corrupts the buffer.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(g.get("fused") and g.get("momentum", 0) != 0 for g in optimizer.param_groups)


def _check_and_unscale_(
    grouped: dict[torch.device, dict[Any, list[torch.Tensor]]],
    found_per_device: dict[torch.device, torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
) -> None:
    """Multiply each group of gradients by ``inv_scale`` and add to its device's entry of
    ``found_per_device`` (made from ``found_inf`` where missing) when any value is inf/NaN."""
    inv_per_device: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in grouped.items():
        if device not in found_per_device:
            found_per_device[device] = found_inf.to(device=device, non_blocking=True, copy=True)
        if device not in inv_per_device:
            inv_per_device[device] = inv_scale.to(device=device, non_blocking=True, copy=True)
        for grads in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_per_device[device], inv_per_device[device])


class _OptimizerStages:
    """unscale_, step and their per-optimizer bookkeeping (see the module docstring)."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply every grad by ``inv_scale`` and record non-finite values, per device.

        Grads are grouped by device and dtype for the foreach kernel; one found_inf per device.
        """
        grouped: dict[torch.device, dict[Any, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # fp16 sparse grads may hold duplicate indices whose sum overflows only once
                        # coalesced: coalesce first so the inf check sees what the optimizer will.
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    # (sharded DTensor gradients apart from plain ones: torch's kernel takes one kind per call)
                    grouped[grad.device][(grad.dtype, type(grad))].append(grad)  # type: ignore[index]
            found_per_device: dict[torch.device, torch.Tensor] = {}
            _check_and_unscale_(grouped, found_per_device, found_inf, inv_scale)
        return found_per_device

    def _inv_scale(self) -> torch.Tensor:
        assert self._scale is not None
        # The reciprocal in float64 then float32, as torch does: fp32 division is not exact under
        # some compile options, and scales are powers of two in the common case anyway.
        if self._scale.device.type == "mps":
            return self._scale.reciprocal()
        return self._scale.double().reciprocal().float()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Call it before clipping or inspecting gradients; at most once per optimizer per step.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._inv_scale()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, self._allow_fp16_grads)
        state["stage"] = _Stage.UNSCALED

    def unscale_deferred_(self, optimizer: torch.optim.Optimizer, pending: list[torch.Tensor]) -> torch.Tensor | None:
        """``unscale_`` for an optimizer some of whose gradients wait elsewhere until its step
        (16-bit storage: they are folded onto the fp32 masters a bucket at a time). The gradients
        the optimizer's parameters hold are unscaled in place as ``unscale_`` does; the ``pending``
        ones are only checked for inf/NaN (multiplied by 1, exactly), and the caller multiplies
        them by the returned inverse scale when it makes them fp32: the same products, so the
        same numbers. Returns None when the scaler is disabled.
        """
        if not self._enabled:
            return None
        self.unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for g in pending:
            grouped[g.device][g.dtype].append(g)
        assert self._scale is not None
        zero = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        with torch.no_grad():  # the same check with an inverse scale of 1: the values stay as they are
            _check_and_unscale_(grouped, state["found_inf_per_device"], zero, torch.ones_like(zero))
        return self._inv_scale()

    def share_skip_decision(self, optimizers: list[torch.optim.Optimizer],
                            across: Callable[[torch.Tensor], None] | None = None) -> None:
        """Make several optimizers skip together: if any one's gradients hold inf/NaN, all skip.

        torch lets each optimizer decide alone, so an overflow in one model part still lets the
        others step (and a clip over all parameters spreads the inf into their grads first). Call
        after ``unscale_`` of each optimizer, before ``step``. No host sync.

        ``across``: makes the combined flag the same on every rank, in place (a MAX all-reduce,
        ``mixprec.distributed``); called on every step, also with one optimizer and no gradients,
        so that every rank joins the collective.
        """
        if not self._enabled or (len(optimizers) < 2 and across is None):
            return
        scale, _ = self._check_scale_growth_tracker("share_skip_decision")
        states = [self._per_optimizer_states[id(o)] for o in optimizers]
        found = [f.to(scale.device, non_blocking=True) for st in states for f in st["found_inf_per_device"].values()]
        if not found and across is None:
            return
        combined = torch.stack(found).sum() if found else torch.zeros((), dtype=torch.float32, device=scale.device)
        if across is not None:
            across(combined)
        for st in states:
            st["found_inf_per_device"] = {d: combined.to(d, non_blocking=True)
                                          for d in st["found_inf_per_device"] or (scale.device,)}

    # ------------------------------------------------------------------ step

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *args: Any, **kwargs: Any):
        # The one host sync of an unfused step: Python must know whether to call optimizer.step().
        found = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        state["host_found_inf"] = found
        return None if found else optimizer.step(*args, **kwargs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and call ``optimizer.step`` unless gradients hold inf/NaN.

        Returns the optimizer's return value, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False) and not _fused_skip_unsafe(optimizer):
            return self._fused_step(optimizer, state, *args, **kwargs)

        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        assert len(state["found_inf_per_device"]) > 0, "No inf checks were recorded for this optimizer."
        retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    def _fused_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *args: Any, **kwargs: Any):
        """Optimizers that unscale and skip on the device: hand them the scale and found_inf tensors."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs["grad_scaler"] = self
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = _Stage.STEPPED
            return retval
        if state["stage"] is _Stage.READY:
            self._check_inf_per_device(optimizer)
        scale = self._get_scale_async()
        assert scale is not None
        found_inf = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
        # Already unscaled by the user (to clip): the optimizer must not unscale again.
        optimizer.grad_scale = (  # type: ignore[attr-defined]
            getattr(optimizer, "grad_scale", None)
            if state["stage"] is _Stage.UNSCALED
            else scale * getattr(optimizer, "grad_scale", 1)
        )
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:  # an optimizer that raised must not keep them: the next step would multiply by a stale scale
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = _Stage.STEPPED
        return retval

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
