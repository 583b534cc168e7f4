"""Delayed scaling: the amax history and the scale update, as Transformer Engine's DelayedScaling.

Each fp8 linear keeps ``amax_history`` (``L x 3``: one column per role, ``casts.ROLES``) and
``scale`` (``3``), both fp32 on the model's device. Row 0 of the history is the current step's slot:
every cast in a training forward or backward raises it to the tensor's amax, while the cast itself
uses ``scale``, computed from the history up to the step before. At the end of the step
(``MixedPrecision.step``, after the optimizer step) ``update`` does, per layer and role, what TE's
``amax_and_scale_update`` kernel does:

- if the slot holds 0 (the tensor was not cast this step, or was all zeros), nothing changes;
- else the history rolls: ``new = [0, h[2], ..., h[L-1], h[0]]`` (slot 0 emptied for the next
  step, the oldest entry dropped, the current step's amax the most recent);
- amax = the largest entry of the old history (``"max"``; NaN entries ignored, as CUDA's
  ``fmaxf`` ignores them) or its slot 0 (``"most_recent"``);
- scale = ``(fp8_max * 2**-margin) / amax`` where that amax is finite and positive, else the
  previous scale (``casts.delayed_scale``).

A step skipped for non-finite gradients is undone here instead: its slot is emptied and nothing
rolls, so its infinities never reach the history. The choice is made on the device
(``torch.where`` on the skip flag): no host sync. All layers are updated together (stacked),
a handful of kernels per step whatever the number of layers.

One difference from TE, on purpose: TE updates after every forward (each micro-batch of
gradient accumulation is a history step); here the history advances once per optimizer step
(``accumulate`` micro-batches fill the same slot), because only then is it known whether the
step was skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.fp8.casts import FloatFormat, delayed_scale


def record_(history: torch.Tensor, role: int | slice, amax_: torch.Tensor) -> None:
    """Raise the current step's slot of ``role`` to ``amax_`` (in place, on the device)."""
    slot = history[0, role]
    slot.copy_(torch.maximum(slot, amax_))


def rolled(history: torch.Tensor) -> torch.Tensor:
    """TE's roll along dim -2 (the steps): ``[0, h[2], ..., h[L-1], h[0]]`` (``[0]`` when L is 1)."""
    h = history
    length = h.shape[-2]
    zero = torch.zeros_like(h[..., :1, :])
    if length == 1:
        return zero
    return torch.cat([zero, h[..., 2:, :], h[..., :1, :]], dim=-2)


def window_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a scale is computed from: the history's largest entry (NaN ignored) or slot 0."""
    if algo == "most_recent":
        return history[..., 0, :]
    # fmaxf semantics: a NaN loses to any number (an inf stays: non-finite keeps the old scale)
    return torch.nan_to_num(history, nan=0.0, posinf=float("inf"), neginf=0.0).amax(dim=-2)


def update(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], formats: Sequence[FloatFormat],
           algo: str, margin: int, skipped: torch.Tensor | None = None) -> None:
    """End of step for every layer: roll each history and recompute each scale, in place (see the
    module docstring); with ``skipped`` (0-d bool tensor) True, only empty the current slots."""
    if not histories:
        return
    h = torch.stack(list(histories))  # (layers, L, 3)
    s = torch.stack(list(scales))  # (layers, 3)
    current = h[:, 0, :]
    seen = current != 0
    new_h = torch.where(seen.unsqueeze(1), rolled(h), h)
    amax_ = window_amax(h, algo)
    new_s = torch.stack([delayed_scale(amax_[:, r], s[:, r], f, margin) for r, f in enumerate(formats)], dim=1)
    new_s = torch.where(seen, new_s, s)
    if skipped is not None:
        emptied = h.clone()
        emptied[:, 0, :] = 0
        new_h = torch.where(skipped, emptied, new_h)
        new_s = torch.where(skipped, s, new_s)
    torch._foreach_copy_(list(histories), list(new_h.unbind(0)))
    torch._foreach_copy_(list(scales), list(new_s.unbind(0)))
