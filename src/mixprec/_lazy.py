"""Names a package exports lazily (PEP 562): each is imported from its module on first use, so
that importing the package (and so ``mixprec --help``) loads no torch, and no jax."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__``:
    ``__getattr__, __dir__ = lazy_exports(__name__, {"name": "package.module"}, globals())``.

    ``__getattr__`` imports ``name`` from its module and keeps it in ``namespace`` (the next lookup
    is a plain attribute read); ``__dir__`` lists the package's globals and its ``__all__``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
