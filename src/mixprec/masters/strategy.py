"""Compatibility only: what was ``mixprec.masters.strategy`` lives in ``buckets``, ``gradients``,
``base`` and ``variants`` now (public names: ``mixprec.masters``).

Kept for one caller not yet moved, ``mixprec.memory`` (``from mixprec.masters.strategy import
BUCKET_NUMEL``). A name read here is looked up in the new modules at the moment it is read, so
``BUCKET_NUMEL`` is the live value of ``mixprec.masters.buckets.BUCKET_NUMEL`` (set that one, not
this). Delete this module once nothing imports it.
"""

from __future__ import annotations

from typing import Any

from mixprec.masters import base, buckets, gradients, variants

_MODULES = (buckets, gradients, base, variants)


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
