"""Hugging Face's ``Conv1D`` in fp8: a matmul with its weight stored transposed.

``transformers.pytorch_utils.Conv1D`` (GPT-2's and GPT's projections: ``c_attn``, ``c_proj``,
``c_fc``) computes ``y = x @ W + b`` with ``W`` of shape ``(in, out)``: ``nn.Linear`` with the
weight transposed. Its fp8 form computes exactly what ``Fp8Linear`` computes for an ``nn.Linear``
whose weight is ``W.T`` (the same casts, the same GEMMs, bit for bit: tests/fp8/test_fp8_conv1d.py);
only the parameter's layout differs, and the weight gradient reaches it transposed back.

The swap keeps ``isinstance(m, Conv1D)`` true: the layer's class becomes a subclass of its own
class (made once per class, ``fp8_class_for``), as ``Fp8Linear`` is of ``nn.Linear``. transformers
is never imported here: a model holding a ``Conv1D`` has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from mixprec.fp8.linear import Fp8Matmul

_MODULE = "transformers.pytorch_utils"
_CLASSES: dict[type, type] = {}


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` when transformers is loaded, else None."""
    return getattr(sys.modules.get(_MODULE), "Conv1D", None)


def is_conv1d(m: nn.Module) -> bool:
    """``m`` is a Hugging Face ``Conv1D`` itself (a subclass may compute something else), or its fp8 form."""
    cls = conv1d_class()
    return cls is not None and (type(m) is cls or type(m) is _CLASSES.get(cls))


def features(m: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Conv1D (its weight is ``(in, out)``)."""
    n_in, n_out = m.weight.shape
    return int(n_in), int(n_out)


class _Fp8Conv1DMixin(Fp8Matmul):
    """The fp8 half of an fp8 ``Conv1D``: its weight seen as ``(out, in)``."""

    def fp8_weight(self) -> torch.Tensor:
        return self.weight.t()

    @property
    def in_features(self) -> int:
        return features(self)[0]  # type: ignore[arg-type]

    @property
    def out_features(self) -> int:
        return features(self)[1]  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Fp8Conv1D(nf={self.out_features}, nx={self.in_features}, {self.fp8_repr()})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # the class is made at run time: pickle it by its base
        return _rebuild, (self.fp8_original_class, self.__getstate__())


def fp8_class_for(cls: type) -> type:
    """The fp8 subclass of a ``Conv1D`` class (one per class, so that ``type(m)`` is stable)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type("Fp8Conv1D", (_Fp8Conv1DMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _rebuild(original: type, state: dict[str, Any]) -> nn.Module:
    obj = fp8_class_for(original).__new__(fp8_class_for(original))
    obj.__setstate__(state)
    return obj
