"""``Policy``: which dtype parameters are stored in, which the compute runs in, which comes out.

The string grammar is jmp's, so a jmp user's policy strings work unchanged:

- ``"p=f32,c=bf16,o=f32"`` or ``"params=float32,compute=bfloat16,output=float32"``: keys ``p``/``params``,
  ``c``/``compute``, ``o``/``output``; params default to f32, compute to params, output to compute.
- ``"bf16"`` (no ``=``): one dtype for all three.

>>> p = get_policy("params=float32,compute=bfloat16,output=float32")
>>> str(p)
'p=f32,c=bf16,o=f32'
>>> import torch
>>> p.cast_to_compute({"x": torch.ones(2), "n": torch.arange(2), "tag": "a"})["x"].dtype
torch.bfloat16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from mixprec.formats import accepted_names, get_format

_KEYS = {
    "p": "param_dtype", "params": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
}


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to ``dtype``.

    Integer and bool tensors, Python scalars and other objects pass through untouched (as in jmp).
    Lists, tuples (named tuples too) and mappings are rebuilt with the same type.
    """
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if isinstance(tree, Mapping):
        return type(tree)((k, cast_floating(v, dtype)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # named tuple
        return type(tree)(*(cast_floating(v, dtype) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(cast_floating(v, dtype) for v in tree)
    return tree


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, compute and outputs (jmp's ``Policy``, over torch dtypes)."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, field)
            # Accept names and normalise to torch dtypes, so Policy("f32", "bf16", "f32") works.
            object.__setattr__(self, field, get_format(value).dtype)

    def cast_to_param(self, tree: Any) -> Any:
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: torch.dtype | str) -> "Policy":
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        name = lambda d: get_format(d).name  # noqa: E731
        return f"p={name(self.param_dtype)},c={name(self.compute_dtype)},o={name(self.output_dtype)}"


def get_policy(policy_name: str | Policy) -> Policy:
    """Parse a policy string (jmp grammar) into a ``Policy``; a ``Policy`` passes through."""
    if isinstance(policy_name, Policy):
        return policy_name
    if not isinstance(policy_name, str):
        raise TypeError(f"expected a policy string such as 'p=f32,c=bf16', got {type(policy_name).__name__}")
    text = policy_name.strip()
    if not text:
        raise ValueError("Empty policy string; expected e.g. 'p=f32,c=bf16,o=f32' or 'bf16'")

    def dtype_of(token: str) -> torch.dtype:
        try:
            return get_format(token).dtype
        except ValueError:
            raise ValueError(
                f"Unknown dtype {token.strip()!r} in policy {policy_name!r}; "
                f"expected one of {', '.join(accepted_names())}" + _recipe_hint(policy_name)
            ) from None

    if "=" not in text:
        d = dtype_of(text)
        return Policy(d, d, d)

    found: dict[str, torch.dtype] = {}
    for part in text.split(","):
        if "=" not in part:
            raise ValueError(
                f"Malformed part {part.strip()!r} in policy {policy_name!r}; "
                "expected key=dtype with keys p/params, c/compute, o/output"
            )
        key, value = (s.strip() for s in part.split("=", 1))
        field = _KEYS.get(key.lower())
        if field is None:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy_name!r}; expected one of "
                "p, params, c, compute, o, output"
            )
        if field in found:
            raise ValueError(f"Key {key!r} given twice in policy {policy_name!r}")
        found[field] = dtype_of(value)

    param = found.get("param_dtype", torch.float32)
    compute = found.get("compute_dtype", param)
    output = found.get("output_dtype", compute)
    return Policy(param, compute, output)


def cast_floating_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating buffer of ``model`` in ``dtype`` (a pure recipe's running statistics)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype))


def _cast_output(out: Any, dtype: torch.dtype) -> Any:
    """``cast_floating(out, dtype)`` for a model's output, without rebuilding what need not be: a
    tensor is cast directly, and a Hugging Face ``ModelOutput`` (a dataclass that is a mutable
    mapping, made fresh by every forward) has its changed entries replaced in place (rebuilding one
    costs ~100 us on a CPU, more than the cast of a small model's logits)."""
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() else out
    if dataclasses.is_dataclass(out) and isinstance(out, MutableMapping):
        for key, value in list(out.items()):
            if isinstance(value, torch.Tensor):
                if value.is_floating_point() and value.dtype != dtype:
                    out[key] = value.to(dtype)
            elif value is not None:
                out[key] = cast_floating(value, dtype)
        return out
    return cast_floating(out, dtype)


class PreparedForward:
    """A prepared model's instance ``forward``: everything ``prepare`` adds to a call of the model,
    in one function (no hooks, so ``nn.Module.__call__`` keeps its fast path):

    - ``input_dtype``: floating inputs cast to it first (``Recipe.pure``);
    - ``autocast``: ``(device_type, dtype)`` of a 16-bit storage recipe: outside any autocast region
      (an evaluation loop, ``generate()``) the forward runs under it, as ``AutocastForward`` does;
    - floating outputs cast to ``output_dtype`` (the policy's output: the loss sees fp32).

    ``watchers``: callables given the forward's own output before the output cast (``doctor`` reads
    the dtype a model computed its loss in)."""

    def __init__(self, module: nn.Module, output_dtype: torch.dtype, *, input_dtype: torch.dtype | None = None,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        self.inner = module.__dict__.get("forward")  # an instance forward someone set before us
        self.module, self.output_dtype, self.input_dtype, self.autocast = module, output_dtype, input_dtype, autocast
        self.watchers: list[Any] = []

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(model.forward) sees the model's own
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_dtype is not None:
            args, kwargs = cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)
        if self.autocast is not None and not torch.is_autocast_enabled(self.autocast[0]):
            with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
                out = self._run(args, kwargs)
        else:
            out = self._run(args, kwargs)
        for watch in self.watchers:
            watch(out)
        return _cast_output(out, self.output_dtype)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        # the class's forward called with the module (see AutocastForward._run for why)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class AutocastForward:
    """A prepared 16-bit-storage model's instance ``forward`` (on the model and on each submodule
    that holds 16-bit weights): outside any autocast region (an evaluation loop,
    ``model.generate(...)``, ``model.get_encoder()(...)``) it runs the forward under autocast to its
    compute dtype, the computation its 16-bit weights are made for; inside one it changes nothing.
    (An instance ``forward`` rather than a pre-hook: a context manager inside a function is what
    ``torch.compile`` traces.)"""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.inner = module.__dict__.get("forward")  # an instance forward someone set before us
        self.module, self.device_type, self.dtype = module, device_type, dtype

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(model.forward) sees the model's own
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled(self.device_type):
            return self._run(args, kwargs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        # The class's forward called with the module, never ``type(m).forward.__get__(m)``:
        # dynamo reads that as ``m.forward``, which is this wrapper, and after a graph break the
        # resumed code calls the wrapper from itself until RecursionError.
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def autocast_outside(model: nn.Module, device_type: str, dtype: torch.dtype, *, root: bool = True) -> list[str]:
    """Give ``model`` (unless ``root`` is False: its ``PreparedForward`` does it) and each of its
    submodules that holds a 16-bit floating parameter (in it or below it) an ``AutocastForward``:
    whichever of them is called first outside autocast (the model, ``model.get_encoder()``,
    ``model.model``, a backbone, a head) enters it. Modules without such a parameter, and
    containers without a forward (``ModuleList``), are left alone. Returns the qualified names of
    the modules wrapped ("" is the model)."""
    wrapped = []
    for name, module in model.named_modules():
        if type(module).forward is nn.Module.forward or isinstance(module.__dict__.get("forward"), AutocastForward):
            continue
        if not root and module is model:
            continue
        if any(p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters()):
            module.forward = AutocastForward(module, device_type, dtype)  # type: ignore[method-assign]
            wrapped.append(name)
    return wrapped


def prepared_forward_options(mp: Any) -> dict[str, Any]:
    """``PreparedForward``'s options for a ``MixedPrecision`` (read by attribute): a pure recipe casts
    the inputs, a 16-bit storage recipe (one with masters) enters autocast outside one."""
    return {"input_dtype": mp.policy.compute_dtype if mp.recipe.pure else None,
            "autocast": (mp.device.type, mp.policy.compute_dtype) if mp.masters is not None else None}


def _recipe_hint(name: str, module: str = "mixprec") -> str:
    """When a policy string looks like a recipe's name ("bf16-mixed"): where its policy is. (Read from the
    recipes module when it is loaded, by the name's shape otherwise: the recipes import this module.)"""
    import sys

    key = name.strip().lower()
    recipes = sys.modules.get(f"{module}.recipes")
    known = getattr(recipes, "recipe_names", None)
    looks = key in known() if known is not None else ("-" in key and "=" not in key)
    return f". {name.strip()!r} is a recipe, not a policy: its policy is {module}.get_recipe({key!r}).policy" if looks else ""
