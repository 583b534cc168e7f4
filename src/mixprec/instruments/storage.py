"""Bytes of tensor storages: distinct storages behind tensors, and the storages alive over a
region with their peak (the CPU's stand-in for ``torch.cuda.max_memory_allocated``).

Shared by ``mixprec memory --measure`` and ``mixprec bench``; imports nothing of either.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ties count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages made while the mode is on and still alive, and their peak: the
    CPU's stand-in for ``torch.cuda.max_memory_allocated`` (every op that makes a new storage is
    seen by the dispatcher; views and in-place ops make none; a storage counts until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.name.endswith("_") or any(a.is_out for a in func._schema.arguments):
            return out  # no new storage
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n == 0 or key in self._seen:
                    continue
                self._seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        if key in self._seen:
            self.live -= n
            self._seen.discard(key)
