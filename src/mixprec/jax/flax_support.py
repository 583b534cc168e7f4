"""``flax.serialization`` for mixprec.jax's state classes (``to_bytes`` / ``from_bytes``,
``to_state_dict`` / ``from_state_dict``, a linen ``TrainState`` with ``tx=skip_nonfinite(...)``).

flax serializes dicts, lists, tuples, namedtuples and arrays; any other class in a state needs a
handler, or ``to_bytes`` raises ``TypeError: can not serialize 'NoOpLossScale'``. Registered here,
when flax is installed (``mixprec.jax`` calls ``register`` on import):

- every loss scale stores its kind, and is restored into the same kind only (a ``DynamicLossScale``
  restored into a ``NoOpLossScale`` target used to vanish without a word);
- ``NoOpLossScale``: nothing else to store;
- ``StaticLossScale``: its scale;
- ``DynamicLossScale``: ``loss_scale``, ``counter``, ``hysteresis_left`` and its configuration
  (period, factor, floor, ceiling, hysteresis), which must equal the target's: restoring into a
  scale built with other settings is refused, naming the difference;
- ``Fp8Meta``: the amax history and scales, with the same check of its configuration.

``SkipNonFiniteState`` and ``Accumulation`` are namedtuples, which flax handles itself.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

_DONE = False


def _config(scale: Any) -> dict[str, Any]:
    return {"period": float(scale.period), "factor": float(scale.factor),
            "min_loss_scale": float(np.asarray(scale.min_loss_scale)),
            "max_loss_scale": None if scale.max_loss_scale is None else float(np.asarray(scale.max_loss_scale)),
            "hysteresis": int(scale.hysteresis), "consecutive_hysteresis": bool(scale.consecutive_hysteresis)}


def _check_config(kind: str, saved: Any, target: dict[str, Any]) -> None:
    if saved is None:
        return
    saved = {k: (None if v is None else type(target[k])(v) if target.get(k) is not None else v) for k, v in saved.items()}
    if saved != target:
        diff = {k: (saved.get(k), target.get(k)) for k in set(saved) | set(target) if saved.get(k) != target.get(k)}
        raise ValueError(f"flax.serialization: the saved {kind} was configured otherwise than the target "
                         f"(saved, target): {diff}; build the target with the saved settings")


def _saved_kind(state: Any) -> str:
    """Which loss scale a saved state dict is (named since it is stored; older ones by their keys)."""
    if not isinstance(state, dict):
        return type(state).__name__
    if "kind" in state:
        return str(state["kind"])
    return "DynamicLossScale" if "counter" in state else "StaticLossScale" if "loss_scale" in state else "NoOpLossScale"


def _check_kind(target: Any, state: Any) -> None:
    """A loss scale is restored into the same kind only (a dynamic scale into a NoOp one lost it silently)."""
    saved, want = _saved_kind(state), type(target).__name__
    if saved != want:
        raise ValueError(f"flax.serialization: the saved loss scale is a {saved}, the target's a {want}: build the "
                         "target with the recipe (or loss scale) the state was saved with, e.g. "
                         "skip_nonfinite(opt, 'fp16-mixed') for a DynamicLossScale")


def register() -> bool:
    """Register the handlers with flax.serialization (once); False when flax is not installed."""
    global _DONE
    if _DONE:
        return True
    try:
        if importlib.util.find_spec("flax") is None:
            return False
        from flax import serialization
    except ImportError:  # flax absent (or blocked): the state classes stay pytrees, as without flax
        return False

    from mixprec.jax.fp8.dot import Fp8Meta
    from mixprec.jax.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, _new

    def dynamic_to(s: DynamicLossScale) -> dict[str, Any]:
        return {"kind": "DynamicLossScale", "loss_scale": s.loss_scale, "counter": s.counter,
                "hysteresis_left": s.hysteresis_left, "config": _config(s)}

    def dynamic_from(target: DynamicLossScale, state: dict[str, Any]) -> DynamicLossScale:
        _check_kind(target, state)
        _check_config("DynamicLossScale", state.get("config"), _config(target))
        fields = {f: getattr(target, f) for f in target.__dataclass_fields__}
        fields.update(loss_scale=state["loss_scale"], counter=state["counter"],
                      hysteresis_left=state.get("hysteresis_left", target.hysteresis_left))
        return _new(DynamicLossScale, **fields)

    def meta_to(m: Fp8Meta) -> dict[str, Any]:
        c = m.config
        return {"amax_history": m.amax_history, "scale": m.scale,
                "config": {"scaling": c.scaling, "amax_history_len": c.amax_history_len,
                           "amax_compute_algo": c.amax_compute_algo, "margin": c.margin,
                           "formats": [np.dtype(f).name for f in c.formats]}}

    def meta_from(target: Fp8Meta, state: dict[str, Any]) -> Fp8Meta:
        _check_config("Fp8Meta", state.get("config"), meta_to(target)["config"])
        return Fp8Meta(state["amax_history"], state["scale"], target.config)

    handlers = [
        (NoOpLossScale, lambda s: {"kind": "NoOpLossScale"}, lambda target, state: _check_kind(target, state) or target),
        (StaticLossScale, lambda s: {"kind": "StaticLossScale", "loss_scale": s.loss_scale},
         lambda target, state: _check_kind(target, state) or _new(StaticLossScale, loss_scale=state["loss_scale"])),
        (DynamicLossScale, dynamic_to, dynamic_from),
        (Fp8Meta, meta_to, meta_from),
    ]
    for cls, to_fn, from_fn in handlers:
        serialization.register_serialization_state(cls, to_fn, from_fn, override=True)
    _DONE = True
    return True
