"""``GradScaler``: the torch-compatible dynamic loss scaler, composed of the seams next to it.

``GradScaler`` subclasses ``torch.amp.GradScaler`` (``isinstance`` checks in trainers hold) without
calling its ``__init__``, and overrides every method torch defines. This module holds its state
(``__init__`` is the one inventory of attributes; the device tensors are created lazily by the
first ``scale()``), ``scale()``, ``update()`` (the end of an iteration: consumes every optimizer's
found-inf tensors, writes the per-step record (``_write_record``, also on ``update(new_scale)``),
then torch's fused update or the bounded one), the getters and setters, ``state_dict`` /
``load_state_dict`` (torch's five keys plus ``mixprec``) and pickling. The mixins hold the rest:
``stages._OptimizerStages`` (unscale_, step), ``bounds._Bounds`` (hysteresis, floor, ceiling, power-of-two bookkeeping) and
``record._StepRecord`` (``last_skipped``, ``history()``...).
"""

from __future__ import annotations

import collections
import math
import warnings
from collections import abc, defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.scaling.bounds import (
    OnFloor,
    _Bounds,
    _check_backoff_factor,
    _check_bounds,
    _check_growth_factor,
    _check_growth_interval,
    _is_power_of_two,
)
from mixprec.scaling.errors import ScalerConfigError, ScaleTypeError
from mixprec.scaling.record import _StepRecord
from mixprec.scaling.stages import _fresh_optimizer_state, _OptimizerStages
from mixprec.scaling.validate import check_device, check_state_dict


class GradScaler(_OptimizerStages, _Bounds, _StepRecord, torch.amp.GradScaler):
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
        # here or in the mixins. Subclassing keeps isinstance(scaler, torch.amp.GradScaler) true for
        # trainers that check. Every attribute of every mixin is set here.
        self._device = check_device(device)
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn(
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        self._allow_fp16_grads = bool(allow_fp16_grads)
        self._record_steps = int(record_steps)
        self._last_found: torch.Tensor | None = None  # last_skipped, formed from _last_found_inf when read
        self._last_found_inf: torch.Tensor | None = None
        self._unfolded: list[torch.Tensor] = []  # found_inf sums not yet counted into _skipped_total
        self._last_scale: torch.Tensor | None = None
        self._last_host_skipped: bool | None = None
        self._pow2 = False  # (set below when enabled; the setters read it on a disabled scaler too)
        if not self._enabled:
            return
        _check_growth_factor(growth_factor)
        _check_backoff_factor(backoff_factor)
        growth_interval = _check_growth_interval(growth_interval)
        _check_bounds(init_scale, hysteresis, min_scale, max_scale, on_floor)

        self._init_scale = init_scale
        self._scale: torch.Tensor | None = None  # created lazily by the first scale() call
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

        # the bounds (bounds._Bounds)
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
        # the per-step record (record._StepRecord; written by update())
        self._init_skipped = 0
        self._skipped_total: torch.Tensor | None = None
        self._updates = 0  # host count of update() calls that consumed inf checks
        self._record: collections.deque[tuple[int, torch.Tensor, torch.Tensor]] = collections.deque(
            maxlen=self._record_steps
        )
        self._pow2 = self._all_powers_of_two(init_scale)

    # ------------------------------------------------------------------ lazy state

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

    # ------------------------------------------------------------------ update

    def discard_step(self) -> None:
        """Forget the step in progress (each optimizer's stage and inf checks) without touching the
        scale: after an exception between ``unscale_`` and ``update``, the next step starts clean
        instead of raising "unscale_() has already been called". ``MixedPrecision.step`` calls it
        when it raises."""
        if self._enabled:
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Lower the scale after an overflow, raise it after ``growth_interval`` clean steps.

        ``update(new_scale)`` sets the scale directly. Call once per iteration, after every
        optimizer's ``step``.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            f.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            # A step taken (or skipped) this iteration is recorded as by a plain update(): the scale
            # the user sets next must not hide that this step was skipped (was_skipped(),
            # skipped_steps, history()). Validated first: a refused new_scale records nothing.
            used = scale.clone() if found_infs else None
            self._set_scale(new_scale)
            if used is not None:
                self._write_record(used, found_infs)
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            return

        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = self._write_record(scale.clone(), found_infs)

        if self._plain:
            torch._amp_update_scale_(
                scale, tracker, combined, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        else:
            self._update_with_bounds(scale, tracker, self.last_skipped)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _write_record(self, scale_used: torch.Tensor, found_infs: list[torch.Tensor]) -> torch.Tensor:
        """The per-step record (record._StepRecord reads it) of the step just taken with
        ``scale_used``; returns the summed found_inf. It keeps the sum, not found_inf > 0: the skip
        flag and the skip count are formed when read (one comparison per read, or per 1024 steps)."""
        combined = found_infs[0]
        for f in found_infs[1:]:
            combined = combined + f
        # .get: code written for torch's GradScaler may have made these states itself (torch's keys only)
        host = [s.get("host_found_inf") for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        self._last_host_skipped = None if any(h is None for h in host) else any(host)
        self._last_found_inf, self._last_found, self._last_scale = combined, None, scale_used
        self._record.append((self._updates, scale_used, combined))
        self._updates += 1
        self._unfolded.append(combined)
        if len(self._unfolded) >= 1024:
            self._fold_skipped()
        return combined

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        assert self._scale is not None
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if isinstance(new_scale, float):
            if not (math.isfinite(new_scale) and new_scale > 0):
                raise ScalerConfigError(f"new_scale must be a finite float > 0, got {new_scale!r}")
            self._scale.fill_(new_scale)
            self._pow2 = self._all_powers_of_two(new_scale)
            return
        if not isinstance(new_scale, torch.Tensor):  # torch refuses an int (8) too; say what it takes
            raise ScaleTypeError(f"{reason} Got {type(new_scale).__name__} {new_scale!r}"
                                 + (f"; write {float(new_scale)!r}" if isinstance(new_scale, int)
                                    and not isinstance(new_scale, bool) else ""))
        if new_scale.device.type != self._device:
            raise AssertionError(reason)
        if new_scale.numel() != 1:
            raise AssertionError(reason)
        if new_scale.requires_grad:
            raise AssertionError(reason)
        self._scale.copy_(new_scale)
        self._pow2 = False  # not known without reading the tensor (a sync): assume not

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

    def get_growth_factor(self) -> float:
        return self._growth_factor

    # The setters refuse what the constructor refuses (torch's take anything): a scaler set to a
    # factor of 0.5 or an interval of 1.5 would save a state_dict() that does not load back.

    def set_growth_factor(self, new_factor: float) -> None:
        if self._enabled:
            _check_growth_factor(new_factor)
        self._growth_factor = new_factor
        self._pow2 = self._pow2 and _is_power_of_two(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        if self._enabled:
            _check_backoff_factor(new_factor)
        self._backoff_factor = new_factor
        self._pow2 = self._pow2 and _is_power_of_two(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = _check_growth_interval(new_interval) if self._enabled else new_interval

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
                "_skipped_total": self._read(self._fold_skipped(), self._init_skipped),
                "_updates": self._updates,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if isinstance(state_dict, Mapping) and len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        state_dict = check_state_dict(state_dict)  # whole, before anything is assigned
        if "mixprec" not in state_dict:  # torch's (or a bare) state: it must fit this scaler's own bounds
            try:
                _check_bounds(state_dict["scale"], self._hysteresis, self._min_scale, self._max_scale, self._on_floor)
            except ScalerConfigError as e:
                raise ScalerConfigError(
                    f"state_dict['scale'] does not fit this scaler: {e}".replace("init_scale", "the loaded scale")
                    + " (the scaler is unchanged). Construct it with min_scale/max_scale that hold the "
                    "loaded scale, or without them"
                ) from None
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
            self._unfolded = []

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
                         "_last_found"):
                state[name] = None
            # The per-step record travels as CPU tensors (one copy of each kind; state_dict() synced
            # already): was_skipped(), last_skipped, last_scale and history() answer the same after
            # unpickling (a fused step's skip is known only from its device tensor).
            state["_last_scale"] = None if self._last_scale is None else self._last_scale.cpu()
            state["_last_found_inf"] = None if self._last_found_inf is None else self._last_found_inf.cpu()
            record = collections.deque(maxlen=self._record_steps)
            if self._record:
                steps, scales, found = zip(*self._record)
                record.extend(zip(steps, torch.stack(scales).cpu().unbind(), torch.stack(found).cpu().unbind()))
            state["_record"] = record
            state["_unfolded"] = []
            state["_per_optimizer_states"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._enabled:
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
