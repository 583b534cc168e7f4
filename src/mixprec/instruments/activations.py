"""Activation memory, measured two ways.

- ``saved_bytes``: the bytes autograd keeps for backward, seen through ``saved_tensors_hooks``,
  each storage counted once, leaving out what existed before the forward (parameters, buffers,
  the batch). Works on any device, so it is what the CPU rows report. It counts autocast's 16-bit
  weight copies, which are real extra memory held until backward.
- ``cuda_forward_delta``: allocated CUDA memory after the forward minus before it (gradients
  cleared): what the allocator really holds, workspace and all.
- ``forward_delta``: the same on any device: on CUDA the allocator's figure, on the CPU the bytes
  of the tensor storages the forward made and still holds (``mixprec.instruments.storage.LiveBytes``,
  when the caller passes one that is on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.instruments.timing import synchronize


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


class SavedTensorMeter:
    """Sum of distinct storages autograd saves for backward while the context is open."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._seen: dict[tuple[str, int], int] = {}
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._exclude and key not in self._seen:
            self._seen[key] = t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def measure_activation_memory(
    forward: Callable[[], torch.Tensor],
    model: nn.Module,
    device: torch.device,
    *,
    inputs: Iterable[torch.Tensor] = (),
    saved_tensors: bool = True,
    live: Any = None,
) -> dict[str, int | None]:
    """Run ``forward`` (returning the loss) once and report what it holds for backward.

    ``inputs`` (the batch) and the model's parameters and buffers are not counted. The caller
    clears gradients first. ``saved_tensors`` False skips the hook count (compiled graphs save
    tensors outside Python's view). ``live``: a ``LiveBytes`` mode the caller has entered (CPU).
    """
    result: dict[str, int | None] = {"saved_bytes": None, "cuda_forward_delta": None, "forward_delta": None}
    live_before = live.live if live is not None else 0
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
    if saved_tensors:
        with SavedTensorMeter(exclude=[*model.parameters(), *model.buffers(), *inputs]) as meter:
            loss = forward()
        result["saved_bytes"] = meter.bytes
    else:
        loss = forward()
    if device.type == "cuda":
        synchronize(device)
        result["cuda_forward_delta"] = result["forward_delta"] = torch.cuda.memory_allocated(device) - before
    elif live is not None:
        result["forward_delta"] = live.live - live_before
    del loss
    return result
