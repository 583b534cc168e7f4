"""fp8 recipes in a pure-function forward: ``recipe.dot_general`` / ``recipe.matmul``, and which dots
of a forward compute in fp8 (the torch side's layer rules).

Unbound (a recipe from ``get_recipe`` called directly), every ``recipe.dot_general`` of an fp8
recipe with stateless scaling (current, none) computes in fp8; delayed scaling needs state and
is refused there. ``compare`` binds the recipe for each trace of the step (``bind``): it first
traces the forward once to list its dots (``discover``), decides each one with the torch side's
rules (``decide``), keeps delayed scaling's ``Fp8Meta`` per fp8 dot, and refuses a forward in which
no dot computes in fp8, which would otherwise train as bf16-mixed under the fp8 recipe's name.

The rules, in order (``mixprec.fp8.swap``'s, with a dot for a linear layer): a dot whose
name matches an ``exclude`` glob stays bf16; the contraction size and the output features must
be multiples of 16 (what fp8 GEMMs need); with ``skip_first_last`` the first and the last dot of
the forward stay bf16 (torchao's advice: the input projection and the head); the rest are fp8.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import jax

from mixprec.jax.fp8.dot import Fp8Meta, fp8_dot_general


@dataclasses.dataclass
class DotSite:
    """One dot of a forward: its name, operand shapes and contraction, and what the rules decided."""

    name: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dimension_numbers: Any
    fp8: bool = False
    why: str = ""

    @property
    def sizes(self) -> tuple[int, int]:
        """(contraction size K, output features N of the rhs)."""
        (_, rc), (_, rb) = self.dimension_numbers
        k = math.prod(self.rhs_shape[d] for d in rc)
        n = math.prod(s for d, s in enumerate(self.rhs_shape) if d not in rc and d not in rb)
        return k, n


class Binding:
    """What a recipe's dots do during one trace: record them (``states`` None, ``sites`` None), or
    compute each as decided, with delayed scaling's state."""

    def __init__(self, sites: dict[str, DotSite] | None = None, states: dict[str, Fp8Meta] | None = None) -> None:
        self.sites = sites
        self.states = states
        self.seen: list[DotSite] = []

    def dot(self, recipe: Any, lhs: Any, rhs: Any, dims: Any, name: str | None, precision: Any,
            preferred_element_type: Any) -> Any:
        name = name or f"dot_{len(self.seen)}"
        if any(s.name == name for s in self.seen):
            raise ValueError(f"recipe.dot_general name {name!r} is used twice in one forward; give each dot its own name")
        dims = jax.tree_util.tree_map(int, dims)
        site = DotSite(name, tuple(lhs.shape), tuple(rhs.shape), dims)
        self.seen.append(site)
        decided = None if self.sites is None else self.sites.get(name)
        if self.sites is not None and decided is None:
            raise ValueError(f"recipe.dot_general {name!r} was not in the forward when it was first traced; the dots of "
                             "a forward must not change between traces")
        if decided is None or not decided.fp8:
            return jax.lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=preferred_element_type)
        meta = None if self.states is None else self.states.get(name)
        return fp8_dot_general(lhs, rhs, dims, recipe.fp8, meta, precision, preferred_element_type)


def recipe_dot(recipe: Any, lhs: Any, rhs: Any, dims: Any, name: str | None, precision: Any,
               preferred_element_type: Any) -> Any:
    binding = recipe._fp8_binding
    if binding is None:
        if recipe.fp8.scaling == "delayed":
            raise ValueError(
                f"recipe {recipe.name!r} scales from an amax history, which is state: outside compare, use the Flax "
                "layers (mixprec.jax.fp8.NnxFp8DotGeneral, linen_dot_general_cls) or "
                "mixprec.jax.fp8.fp8_dot_general(..., meta=Fp8Meta.init(recipe.fp8)) and fp8.update"
            )
        return fp8_dot_general(lhs, rhs, dims, recipe.fp8, None, precision, preferred_element_type)
    return binding.dot(recipe, lhs, rhs, dims, name, precision, preferred_element_type)


def bind(recipe: Any, binding: Binding) -> Any:
    return dataclasses.replace(recipe, _fp8_binding=binding)


def decide(recipe: Any, seen: list[DotSite]) -> dict[str, DotSite]:
    """The torch side's layer rules (module docstring) applied to the dots of a forward, in order."""
    sites = {s.name: dataclasses.replace(s) for s in seen}
    ordered = list(sites.values())
    for i, s in enumerate(ordered):
        k, n = s.sizes
        if any(fnmatch.fnmatchcase(s.name, pattern) for pattern in recipe.fp8_exclude):
            s.why = "excluded"
        elif k % 16 or n % 16:
            s.why = f"contraction {k} x features {n}: fp8 GEMMs need multiples of 16"
        elif recipe.fp8_skip_first_last and i in (0, len(ordered) - 1):
            s.why = ("the first dot" if i == 0 else "the last dot") + " (skip_first_last)"
        else:
            s.fp8, s.why = True, recipe.fp8.describe()
    return sites


def describe(sites: dict[str, DotSite]) -> dict[str, str]:
    return {s.name: ("fp8" if s.fp8 else "bf16") + f": {s.why}" for s in sites.values()}


def no_fp8_message(recipe: Any, task_name: str, sites: dict[str, DotSite]) -> str:
    if not sites:
        return (f"recipe {recipe.name!r}: task {task_name!r} computes no dot through recipe.dot_general / recipe.matmul, "
                "so nothing would compute in fp8 and the run would be bf16-mixed under the fp8 name. Multiply the "
                "layers' kernels with recipe.matmul(x, kernel) in the task's apply")
    listed = "; ".join(f"{name}: {why}" for name, why in describe(sites).items())
    return (f"recipe {recipe.name!r}: no dot of task {task_name!r} is eligible for fp8 ({listed}), so the run would "
            "be bf16-mixed under the fp8 name")
