"""How commands read their shared arguments: ``--task-arg KEY=VALUE`` (the task factory's keyword
arguments) and ``--recipes fp32,bf16-mixed p=f32,c=f16 all`` (several recipe names). Shared by
compare, doctor, infer-check and the JAX compare; pure Python (no torch: ``--help`` stays fast).
"""

from __future__ import annotations

import ast
from typing import Any


def parse_task_args(items: list[str]) -> dict[str, Any]:
    """``["d_model=64", "name=x"]`` -> ``{"d_model": 64, "name": "x"}`` (Python literals, else strings)."""
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--task-arg {item!r}: expected KEY=VALUE with KEY a Python name, e.g. d_model=64")
        try:
            kwargs[key.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = raw
    return kwargs


def split_recipes(items: list[str] | None) -> tuple[str, ...] | None:
    """``["fp32,bf16-mixed", "p=f32,c=f16"]`` -> ``("fp32", "bf16-mixed", "p=f32,c=f16")``.

    Commas separate names, except inside a jmp policy string (an item with '='), whose commas are its own.
    ``all`` stands for every registered recipe (``mixprec recipes``).
    """
    if items is None:
        return None
    names: list[str] = []
    for item in items:
        names += [item.strip()] if "=" in item else [n.strip() for n in item.split(",") if n.strip()]
    if any(n.lower() == "all" for n in names):
        from mixprec.recipes import list_recipes

        every = [r.name for r in list_recipes()]
        names = [m for n in names for m in (every if n.lower() == "all" else [n])]
    return tuple(dict.fromkeys(names))  # in order, each once
