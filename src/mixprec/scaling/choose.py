"""``scaler_for``: the loss scaler a recipe trains with, from what ``MixedPrecision(scaler=...)`` was given."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling.scaler import GradScaler
from mixprec.scaling.static import NoOpScaler, StaticLossScaler


def scaler_for(recipe: Any, device: torch.device, scaler: GradScaler | dict[str, Any] | None,
               skip_nonfinite: bool) -> GradScaler:
    """``scaler``: None (the recipe's), a dict of ``GradScaler`` keyword arguments, or a mixprec scaler
    (returned as it is). ``skip_nonfinite``: a recipe without a loss scaler still skips non-finite
    steps (a ``StaticLossScaler(1.0)``)."""
    dev = device.type
    if isinstance(scaler, GradScaler):
        return scaler
    if scaler is not None and not isinstance(scaler, dict):
        raise TypeError(
            f"scaler must be None, a dict of GradScaler arguments, or a mixprec scaler; got "
            f"{type(scaler).__name__}. (A torch.amp.GradScaler cannot report skipped steps without "
            "a sync; pass its arguments as a dict instead.)"
        )
    kwargs = dict(scaler or {})
    kind = recipe.loss_scaling
    if kind == "dynamic":
        return GradScaler(dev, **kwargs)
    if kind == "static":
        return StaticLossScaler(kwargs.pop("scale", recipe.static_scale), dev, **kwargs)
    if kwargs:
        raise ValueError(
            f"Recipe {recipe.name!r} uses no loss scaler, so scaler arguments {sorted(kwargs)} "
            "would be ignored; drop them, or choose an fp16 recipe"
        )
    if skip_nonfinite:
        return StaticLossScaler(1.0, dev)
    return NoOpScaler(dev)
