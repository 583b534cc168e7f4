"""Loss scalers: a drop-in ``GradScaler`` and its static and no-op siblings.

``GradScaler`` accepts ``torch.amp.GradScaler``'s constructor, methods, state machine and errors
unchanged, and with default arguments produces the same scales, skip decisions and parameters
(tests/test_scaling_differential.py checks this over thousands of random steps). On top:

- ``hysteresis`` / ``consecutive_hysteresis``: DeepSpeed's rule (an overflow lowers the scale only
  after ``hysteresis`` overflows; the counter refills on growth, or on every clean step when
  consecutive).
- ``min_scale`` / ``max_scale`` and ``on_floor`` ("raise", "warn" or "skip"): torch's scale can
  collapse toward 0 silently (pytorch#99640); here it stops at the floor and you choose what happens.
- fp16 gradients are unscaled instead of refused (``allow_fp16_grads``), see the caveat there.
- A per-step record (scale used, skipped) kept as device tensors: recording costs no host sync.
  ``last_skipped`` is a 0-d device tensor; ``was_skipped()`` gives a bool.

Where host syncs remain: an unfused optimizer's ``step`` reads found_inf with ``.item()`` to decide
whether to call ``optimizer.step()`` (one sync per optimizer per step, as in torch). Fused
optimizers (``Adam/AdamW/Adagrad/SGD(fused=True)``) receive ``grad_scale`` / ``found_inf`` tensors and
skip on the device: ``scale``/``unscale_``/``step``/``update`` then never sync. Exception: fused SGD
with momentum corrupts its momentum buffer on skipped steps (a torch bug), so it takes the
unfused, syncing path here. ``get_scale()``,
``state_dict()``, ``was_skipped()`` and ``history()`` read device values and so sync when called.
With a fused optimizer, ``on_floor="raise"/"warn"`` is checked at those reads (``check_floor()``);
with an unfused one it is checked in ``update()`` on overflow steps only.
"""

from __future__ import annotations

import collections
import inspect
import math
import warnings
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Literal

import torch

OnFloor = Literal["raise", "warn", "skip"]


def _is_power_of_two(x: Any) -> bool:
    """A positive finite float whose mantissa is exactly 1 (multiplying by it, or by its
    reciprocal, is exact in binary floating point unless the result leaves the format's range)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


class ScaleFloorError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``."""


class ScalerConfigError(ValueError, AssertionError):
    """Bad scaler configuration. Also an AssertionError: torch's GradScaler raises that type."""


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf_per_device": {}, "host_found_inf": None}


def _fused_skip_unsafe(optimizer: torch.optim.Optimizer) -> bool:
    """Fused optimizers whose on-device skip is known to touch state it must leave alone.

    torch's fused SGD with momentum writes the momentum buffer on a step its ``found_inf`` says to
    skip (on a first step it is left uninitialised: seen on torch 2.13 CPU; reported on 2.11 CUDA,
    LibreYOLO PR #771), so the next real step diverges. Such optimizers take the unfused path:
    the host decides, and a skipped step never calls ``optimizer.step()``. That costs the sync the
    fused path avoids, and departs from torch's GradScaler, which corrupts the buffer.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(g.get("fused") and g.get("momentum", 0) != 0 for g in optimizer.param_groups)


def _check_and_unscale_(
    grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]],
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


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaler, compatible with ``torch.amp.GradScaler``.

    Args beyond torch's:
        hysteresis: overflows tolerated before the scale is lowered (1 = torch's behaviour).
        consecutive_hysteresis: refill the hysteresis counter on every clean step, so only
            back-to-back overflows lower the scale (DeepSpeed's option); otherwise it refills on growth.
        min_scale: the floor; ``None`` (default, as torch) means none.
        max_scale: the ceiling; ``None`` (default, as torch) means none.
        on_floor: what happens when gradients overflow at ``min_scale``: "raise" a
            ``ScaleFloorError``, "warn" (default), or "skip" silently (Megatron's behaviour).
        allow_fp16_grads: unscale fp16 ``.grad`` tensors in place (default True) instead of raising
            torch's ``ValueError("Attempting to unscale FP16 gradients.")``. Unscaling in fp16 flushes
            gradients below 2**-24 to zero again; keep fp32 master gradients (``fp16-true``) when
            that matters.
        record_steps: how many recent steps ``history()`` keeps.

    >>> scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
    >>> scaler.scale((w * 3).sum()).backward(); _ = scaler.step(opt); scaler.update()
    >>> scaler.get_scale(), scaler.was_skipped(), w.grad.tolist()
    (1024.0, False, [3.0, 3.0])
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_floor: OnFloor = "warn",
        allow_fp16_grads: bool = True,
        record_steps: int = 4096,
    ) -> None:
        # torch.amp.GradScaler.__init__ is not called: every method it would set up is defined
        # here. Subclassing keeps isinstance(scaler, torch.amp.GradScaler) true for trainers that check.
        self._device = str(device)
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn(
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        self._allow_fp16_grads = bool(allow_fp16_grads)
        self._record_steps = int(record_steps)
        self._last_found: torch.Tensor | None = None
        self._last_scale: torch.Tensor | None = None
        self._last_host_skipped: bool | None = None
        if not self._enabled:
            return
        if growth_factor <= 1.0:
            raise ScalerConfigError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise ScalerConfigError("The backoff factor must be < 1.0.")
        if int(hysteresis) < 1:
            raise ScalerConfigError(f"hysteresis must be an integer >= 1 (1 = torch's behaviour), got {hysteresis}")
        if min_scale is not None and not min_scale > 0:
            raise ScalerConfigError(f"min_scale must be > 0 or None, got {min_scale}")
        if max_scale is not None and min_scale is not None and max_scale < min_scale:
            raise ScalerConfigError(f"max_scale ({max_scale}) is below min_scale ({min_scale})")
        if on_floor not in ("raise", "warn", "skip"):
            raise ScalerConfigError(f"on_floor must be 'raise', 'warn' or 'skip', got {on_floor!r}")
        if min_scale is not None and init_scale < min_scale:
            raise ScalerConfigError(f"init_scale ({init_scale}) is below min_scale ({min_scale})")
        if max_scale is not None and init_scale > max_scale:
            raise ScalerConfigError(f"init_scale ({init_scale}) is above max_scale ({max_scale})")

        self._init_scale = init_scale
        self._scale: torch.Tensor | None = None  # created lazily by the first scale() call
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

        self._hysteresis = int(hysteresis)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._on_floor: OnFloor = on_floor
        self._init_hysteresis_tracker = self._hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None
        self._init_floor_hits = 0
        self._floor_hits: torch.Tensor | None = None  # overflows seen at the floor (device counter)
        self._floor_hits_reported = 0
        self._init_skipped = 0
        self._skipped_total: torch.Tensor | None = None
        self._updates = 0  # host count of update() calls that consumed inf checks
        self._record: collections.deque[tuple[int, torch.Tensor, torch.Tensor]] = collections.deque(
            maxlen=self._record_steps
        )
        self._pow2 = self._all_powers_of_two(init_scale)

    def _all_powers_of_two(self, scale: Any) -> bool:
        """Whether every scale this scaler can reach from ``scale`` is a power of two: the scale,
        both factors and the bounds are (products and clamps of powers of two stay powers of two)."""
        return all(_is_power_of_two(v) for v in (scale, self._growth_factor, self._backoff_factor,
                                                  self._min_scale or 1.0, self._max_scale or 1.0))

    @property
    def scale_is_power_of_two(self) -> bool:
        """True when the scale is known to be a power of two (host state, no sync): the default
        factors keep it so, and then ``x * (1/scale)`` is exact, so a norm of scaled gradients times
        ``1/scale`` is bitwise the norm of the unscaled ones. False is conservative (a factor or a
        bound that is not a power of two, or a scale set from a tensor)."""
        return self._enabled and self._pow2

    # ------------------------------------------------------------------ lazy state

    @property
    def _plain(self) -> bool:
        """True when the update rule is exactly torch's (one fused kernel does it)."""
        return self._hysteresis == 1 and self._min_scale is None and self._max_scale is None

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        assert self._growth_tracker is None, "_growth_tracker initialized before _scale"
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._floor_hits = torch.full((), self._init_floor_hits, dtype=torch.int32, device=dev)
        self._skipped_total = torch.full((), self._init_skipped, dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ scale

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or an iterable of tensors, nested) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(val.device)
                assert self._scale is not None
                if val.device not in per_device:
                    per_device[val.device] = self._scale.to(device=val.device, non_blocking=True)
                return val * per_device[val.device]
            if isinstance(val, abc.Iterable):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # ------------------------------------------------------------------ unscale

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
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
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
                    grouped[grad.device][grad.dtype].append(grad)
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

    def share_skip_decision(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make several optimizers skip together: if any one's gradients hold inf/NaN, all skip.

        torch lets each optimizer decide alone, so an overflow in one model part still lets the
        others step (and a clip over all parameters spreads the inf into their grads first). Call
        after ``unscale_`` of each optimizer, before ``step``. No host sync.
        """
        if not self._enabled or len(optimizers) < 2:
            return
        scale, _ = self._check_scale_growth_tracker("share_skip_decision")
        states = [self._per_optimizer_states[id(o)] for o in optimizers]
        found = [f.to(scale.device, non_blocking=True) for st in states for f in st["found_inf_per_device"].values()]
        if not found:
            return
        combined = torch.stack(found).sum()
        for st in states:
            st["found_inf_per_device"] = {d: combined.to(d, non_blocking=True) for d in st["found_inf_per_device"]}

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
        retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
        return retval

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Lower the scale after an overflow, raise it after ``growth_interval`` clean steps.

        ``update(new_scale)`` sets the scale directly. Call once per iteration, after every
        optimizer's ``step``.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(new_scale)
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            return

        found_infs = [
            f.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = found_infs[0]
        for f in found_infs[1:]:
            combined = combined + f
        host = [s["host_found_inf"] for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        self._last_host_skipped = None if any(h is None for h in host) else any(host)

        found = combined > 0
        self._last_found, self._last_scale = found, scale.clone()
        self._record.append((self._updates, self._last_scale, found))
        self._updates += 1
        assert self._skipped_total is not None
        self._skipped_total.add_(found)

        if self._plain:
            torch._amp_update_scale_(
                scale, tracker, combined, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        else:
            self._update_with_bounds(scale, tracker, found)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _update_with_bounds(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor) -> None:
        """Hysteresis, floor and ceiling, computed on the device (no host sync).

        Products are formed in float64 and rounded once to float32, as torch's kernel does with its
        double factors, so factors that are not powers of two round the same way.
        """
        hyst, floor_hits = self._hysteresis_tracker, self._floor_hits
        assert hyst is not None and floor_hits is not None
        scale64 = scale.double()
        # overflow: lower the scale only once the hysteresis counter has run down to 1
        lower = found & (hyst <= 1)
        lowered = scale64 * self._backoff_factor
        if self._min_scale is not None:
            floor_hit = lower & (scale <= self._min_scale)
            floor_hits.add_(floor_hit)
            lowered = lowered.clamp(min=self._min_scale)
        # clean: grow after growth_interval consecutive clean steps (if the result is finite)
        counted = tracker + 1
        grow = ~found & (counted >= self._growth_interval)
        grown = scale64 * self._growth_factor
        if self._max_scale is not None:
            grown = grown.clamp(max=self._max_scale)
        grown = torch.where(torch.isfinite(grown.float()), grown, scale64)
        new_scale = torch.where(lower, lowered, torch.where(grow, grown, scale64)).float()
        new_tracker = torch.where(found | grow, torch.zeros_like(tracker), counted)
        refill = ~found if self._consecutive_hysteresis else grow
        new_hyst = torch.where(found & (hyst > 1), hyst - 1, torch.where(refill, torch.full_like(hyst, self._hysteresis), hyst))
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)
        if self._min_scale is not None and self._on_floor != "skip" and self._last_host_skipped:
            # The host already knows this step overflowed (unfused step synced): one more read,
            # on overflow steps only, tells whether it happened at the floor.
            self.check_floor()

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        assert self._scale is not None
        if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
            self._scale.fill_(float(new_scale))
            self._pow2 = self._all_powers_of_two(new_scale)
            return
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if not isinstance(new_scale, torch.Tensor):
            raise AssertionError(reason)
        if new_scale.device.type != self._device:
            raise AssertionError(reason)
        if new_scale.numel() != 1:
            raise AssertionError(reason)
        if new_scale.requires_grad:
            raise AssertionError(reason)
        self._scale.copy_(new_scale)
        self._pow2 = False  # not known without reading the tensor (a sync): assume not

    def check_floor(self) -> None:
        """Raise or warn (per ``on_floor``) if gradients overflowed at ``min_scale`` since the last check.

        Reads a device counter, so it syncs; ``update()`` calls it itself only on overflow steps of
        unfused optimizers, where the host already synced.
        """
        if not self._enabled or self._min_scale is None or self._floor_hits is None or self._on_floor == "skip":
            return
        hits = int(self._floor_hits.item())
        if hits <= self._floor_hits_reported:
            return
        self._floor_hits_reported = hits
        msg = (
            f"Gradients overflowed with the loss scale already at its floor (min_scale={self._min_scale:g}); "
            f"{hits} such step(s) so far were skipped. The scale cannot go lower: the gradients are "
            "non-finite at any scale, which points at the model, not the scaler. Check the same step in "
            "fp32 ('mixprec doctor'), or use bf16."
        )
        if self._on_floor == "raise":
            raise ScaleFloorError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ reading state

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a float (syncs). 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        scale = self._get_scale_async()
        self.check_floor()
        return self._init_scale if scale is None else float(scale.item())

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a 0-d device tensor (no sync); None before the first ``scale()``."""
        return self._scale if self._enabled else None

    @property
    def last_skipped(self) -> torch.Tensor | None:
        """0-d bool device tensor: did the last ``update()``'s step overflow (and so skip)? No sync."""
        return self._last_found

    @property
    def last_scale(self) -> torch.Tensor | None:
        """0-d device tensor: the scale the last ``update()``'s step was taken (or skipped) with."""
        return self._last_scale

    def was_skipped(self) -> bool:
        """Whether the last step was skipped. Free after an unfused step; otherwise one sync."""
        if self._last_host_skipped is not None:
            return self._last_host_skipped
        if self._last_found is None:
            return False
        self.check_floor()
        return bool(self._last_found.item())

    @property
    def skipped_steps(self) -> torch.Tensor | None:
        """Total skipped steps as a 0-d device tensor (no sync)."""
        return self._skipped_total if self._enabled else None

    def history(self) -> dict[str, torch.Tensor]:
        """The last ``record_steps`` steps as CPU tensors: ``step``, ``scale`` (used), ``skipped``.

        One sync for all of them.
        """
        if not self._enabled or not self._record:
            return {
                "step": torch.zeros(0, dtype=torch.int64),
                "scale": torch.zeros(0),
                "skipped": torch.zeros(0, dtype=torch.bool),
            }
        steps, scales, found = zip(*self._record)
        return {
            "step": torch.tensor(steps, dtype=torch.int64),
            "scale": torch.stack(scales).cpu(),
            "skipped": torch.stack(found).cpu(),
        }

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor
        self._pow2 = self._pow2 and _is_power_of_two(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor
        self._pow2 = self._pow2 and _is_power_of_two(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ checkpoints

    def _read(self, tensor: torch.Tensor | None, initial: int) -> int:
        return initial if tensor is None else int(tensor.item())

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (loadable by ``torch.amp.GradScaler``) plus ``mixprec`` extras; ``{}`` when disabled."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "mixprec": {
                "hysteresis": self._hysteresis,
                "consecutive_hysteresis": self._consecutive_hysteresis,
                "min_scale": self._min_scale,
                "max_scale": self._max_scale,
                "on_floor": self._on_floor,
                "_hysteresis_tracker": self._read(self._hysteresis_tracker, self._init_hysteresis_tracker),
                "_floor_hits": self._read(self._floor_hits, self._init_floor_hits),
                "_floor_hits_reported": self._floor_hits_reported,
                "_skipped_total": self._read(self._skipped_total, self._init_skipped),
                "_updates": self._updates,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = state_dict["scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        extra = state_dict.get("mixprec")
        if extra is not None:
            self._hysteresis = extra["hysteresis"]
            self._consecutive_hysteresis = extra["consecutive_hysteresis"]
            self._min_scale = extra["min_scale"]
            self._max_scale = extra["max_scale"]
            self._on_floor = extra["on_floor"]
            self._init_hysteresis_tracker = extra["_hysteresis_tracker"]
            self._init_floor_hits = extra["_floor_hits"]
            self._floor_hits_reported = extra["_floor_hits_reported"]
            self._init_skipped = extra["_skipped_total"]
            self._updates = extra["_updates"]
        self._pow2 = self._all_powers_of_two(self._init_scale)
        if self._scale is not None:
            # Already live: write the loaded values into the existing device tensors.
            assert self._growth_tracker is not None and self._hysteresis_tracker is not None
            assert self._floor_hits is not None and self._skipped_total is not None
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            self._floor_hits.fill_(self._init_floor_hits)
            self._skipped_total.fill_(self._init_skipped)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # Tensors are re-created lazily on the first scale() after unpickling.
            sd = self.state_dict()["mixprec"]
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = sd["_hysteresis_tracker"]
            state["_init_floor_hits"] = sd["_floor_hits"]
            state["_init_skipped"] = sd["_skipped_total"]
            for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_floor_hits", "_skipped_total",
                         "_last_found", "_last_scale"):
                state[name] = None
            state["_record"] = collections.deque(maxlen=self._record_steps)
            state["_per_optimizer_states"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._enabled:
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


class StaticLossScaler(GradScaler):
    """A fixed loss scale with the same interface: steps with inf/NaN gradients are skipped, the
    scale never changes. ``StaticLossScaler(1.0)`` is a pure non-finite-step guard.

    >>> s = StaticLossScaler(2.0**12, device="cpu")
    >>> s.get_scale()
    4096.0
    """

    def __init__(self, scale: float = 2.0**15, device: str = "cuda", enabled: bool = True, **kwargs: Any) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ScalerConfigError(f"StaticLossScaler needs a scale > 0 (a number), got {scale!r}")
        # growth_interval is never reached: _update_with_bounds is replaced below.
        super().__init__(device, init_scale=scale, enabled=enabled, **kwargs)

    @property
    def _plain(self) -> bool:
        return False

    def _update_with_bounds(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor) -> None:
        pass  # the scale is static; skipping is decided by step(), recording by update()


class NoOpScaler(GradScaler):
    """The scaler of recipes that need none (fp32, bf16): ``scale`` returns its input, ``step`` calls
    ``optimizer.step()``, everything else does nothing. One training loop serves every recipe.

    >>> NoOpScaler().get_scale(), NoOpScaler().state_dict()
    (1.0, {})
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device, enabled=False)
