"""Checks of what a ``GradScaler`` is given from outside: its device, and a state dict to load.

``check_device`` refuses a device type torch does not know (torch's GradScaler accepts any string,
``"tpu"`` included, and fails later or never). ``check_state_dict`` validates a state dict from
``GradScaler.state_dict()`` or ``torch.amp.GradScaler.state_dict()`` completely, before anything is
assigned, so a bad one raises a ``ScalerConfigError`` naming the key and leaves the scaler as it was
(torch assigns key by key and accepts ``{"scale": "big"}``: ``get_scale()`` then returns "big").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.scaling.bounds import _check_bounds
from mixprec.scaling.errors import ScalerConfigError

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
MIXPREC_KEYS = ("hysteresis", "consecutive_hysteresis", "min_scale", "max_scale", "on_floor",
                "_hysteresis_tracker", "_floor_hits", "_floor_hits_reported", "_skipped_total", "_updates")


def check_device(device: Any) -> str:
    """``device`` as the string the scaler keeps, or ``ScalerConfigError`` for one torch does not know."""
    text = str(device)
    try:
        torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise ScalerConfigError(
            f"GradScaler device {text!r} is not a torch device type; pass the type of the device the loss is "
            "on: 'cuda' or 'cpu' (or 'xpu', 'mps', 'hpu', ...; see torch.device)"
        ) from None
    return text


def _number(state: Mapping[str, Any], key: str, where: str) -> float:
    v = state[key]
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ScalerConfigError(f"{where}[{key!r}] must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(float(v)):
        raise ScalerConfigError(f"{where}[{key!r}] must be finite, got {v!r}")
    return float(v)


def _count(state: Mapping[str, Any], key: str, where: str, low: int = 0) -> int:
    v = state[key]
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ScalerConfigError(f"{where}[{key!r}] must be an integer >= {low}, got {v!r}")
    return int(v)


def check_state_dict(state: Any) -> dict[str, Any]:
    """Validate a scaler state dict; return it with its numbers normalised (floats, ints).

    Raises ``TypeError`` for something that is not a mapping and ``ScalerConfigError`` (a
    ValueError) naming the missing or bad key. Nothing is assigned here.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"GradScaler.load_state_dict expects the dict scaler.state_dict() returned, got "
                        f"{type(state).__name__}")
    where = "state_dict"
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise ScalerConfigError(
            f"not a GradScaler state dict: missing {', '.join(repr(k) for k in missing)} (it has "
            f"{sorted(map(str, state))}); pass what scaler.state_dict() returned"
        )
    out: dict[str, Any] = {"scale": _number(state, "scale", where)}
    if not out["scale"] > 0:
        raise ScalerConfigError(f"{where}['scale'] must be > 0, got {state['scale']!r}")
    out["growth_factor"] = _number(state, "growth_factor", where)
    out["backoff_factor"] = _number(state, "backoff_factor", where)
    if not out["growth_factor"] > 1.0:
        raise ScalerConfigError(f"{where}['growth_factor'] must be > 1.0, got {state['growth_factor']!r}")
    if not 0.0 < out["backoff_factor"] < 1.0:
        raise ScalerConfigError(f"{where}['backoff_factor'] must be in (0, 1), got {state['backoff_factor']!r}")
    out["growth_interval"] = _count(state, "growth_interval", where, low=1)
    out["_growth_tracker"] = _count(state, "_growth_tracker", where)
    extra = state.get("mixprec")
    if extra is None:
        return out
    where = "state_dict['mixprec']"
    if not isinstance(extra, Mapping) or any(k not in extra for k in MIXPREC_KEYS):
        have = sorted(map(str, extra)) if isinstance(extra, Mapping) else type(extra).__name__
        raise ScalerConfigError(f"{where} is not mixprec's scaler extras (expected keys {list(MIXPREC_KEYS)}, "
                                f"got {have}); pass what scaler.state_dict() returned")
    bounds = {k: None if extra[k] is None else _number(extra, k, where) for k in ("min_scale", "max_scale")}
    ex: dict[str, Any] = {"hysteresis": _count(extra, "hysteresis", where, low=1), **bounds,
                          "consecutive_hysteresis": bool(extra["consecutive_hysteresis"]), "on_floor": extra["on_floor"]}
    for k in ("_hysteresis_tracker", "_floor_hits", "_floor_hits_reported", "_skipped_total", "_updates"):
        ex[k] = _count(extra, k, where)
    try:  # the same rules the constructor applies (a floor above the scale, an unknown on_floor...)
        _check_bounds(out["scale"], ex["hysteresis"], ex["min_scale"], ex["max_scale"], ex["on_floor"])
    except ScalerConfigError as e:
        raise ScalerConfigError(f"{where}: {e}") from None
    out["mixprec"] = ex
    return out
