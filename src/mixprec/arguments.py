"""How commands read their shared arguments: ``--task-arg KEY=VALUE`` (the task factory's keyword
arguments) and ``--recipes fp32,bf16-mixed p=f32,c=f16 all`` (several recipe names). Shared by
compare, doctor, infer-check and the JAX compare; pure Python (no torch: ``--help`` stays fast).
"""

from __future__ import annotations

import argparse
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


def split_names(text: str) -> list[str]:
    """``"fp32,p=f32,c=bf16,o=f32,bf16-true"`` -> ``["fp32", "p=f32,c=bf16,o=f32", "bf16-true"]``.

    Commas separate recipe names, except between the ``key=value`` parts of a jmp policy string:
    consecutive parts with '=' are one policy, until a key comes again (the next policy starts).
    """
    out: list[str] = []
    keys: set[str] = set()  # the keys of the policy string being gathered (out[-1])
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key = part.split("=", 1)[0].strip().lower() if "=" in part else None
        if key is not None and out and keys and key not in keys:
            out[-1] += "," + part
            keys.add(key)
        else:
            out.append(part)
            keys = {key} if key is not None else set()
    return out


def split_recipes(items: list[str] | None) -> tuple[str, ...] | None:
    """``["fp32,bf16-mixed", "p=f32,c=f16"]`` -> ``("fp32", "bf16-mixed", "p=f32,c=f16")``.

    Commas separate names, except inside a jmp policy string, whose commas are its own
    (``split_names``). ``all`` stands for every registered recipe that is a way to train
    (``mixprec recipes``); the UNSAFE demonstration baselines (``bf16-pure``, ``fp16-pure``,
    ``fp8-unscaled``: they fail by design) run only when named, or as ``baselines``.
    """
    if items is None:
        return None
    names: list[str] = []
    for item in items:
        names += split_names(item)
    groups = {"all": lambda r: not r.unsafe, "baselines": lambda r: r.unsafe}
    if any(n.lower() in groups for n in names):
        from mixprec.recipes import list_recipes

        names = [m for n in names
                 for m in ([r.name for r in list_recipes() if groups[n.lower()](r)] if n.lower() in groups else [n])]
    return tuple(dict.fromkeys(names))  # in order, each once


def count(text: str) -> int:
    """argparse type: an integer >= 0 (a step number, how many of something)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (steps, seeds, threads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
