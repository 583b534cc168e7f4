"""fp32 islands: regions and modules that run in fp32 inside a 16-bit forward.

Three tools:

- ``fp32_island()``: a context manager; autocast is off inside, so ops run in the dtype of their
  inputs (cast them up with ``.float()``, or let ``Fp32Island`` do it for a module).
- ``keep_fp32(model, rule)``: make chosen submodules islands: autocast off inside, floating inputs
  cast to fp32, floating outputs cast back to the 16-bit dtype the module received. Parameters and
  state-dict keys are untouched (it is done in a wrapper set as the module's instance ``forward``).
- ``Fp32LayerNorm`` / ``Fp32GroupNorm`` / ``Fp32RMSNorm``: norms whose statistics are computed in
  fp32 whatever the input and parameter dtypes are (also with 16-bit stored weights).

Why norms: under CPU autocast ``layer_norm`` is not on the fp32 list and runs in bf16 (on CUDA it
runs in fp32), and a variance of small activations underflows in fp16. An island makes the
numerics the same on every device.

Under ``torch.compile`` islands trace into one graph on torch 2.11 and 2.13 alike (both tested).
Built-in norms only cast, since a norm computes in fp32 once its inputs are fp32; an island around
a module that autocast would lower (a Linear head) also runs its forward inside
``torch.autocast(..., enabled=False)`` (a context manager inside a function is what dynamo traces;
a switch made in a pre-hook and undone in a post-hook is not, on every version). One wrapper call
per island call and no hooks: a module without hooks takes ``nn.Module.__call__``'s fast path,
and the casts cost what a hand-written ``norm(x.float()).to(x.dtype)`` costs.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
>>> keep_fp32(net, ["norms"])
['1']
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     y = net(torch.randn(2, 4))
>>> y.dtype  # the island computed in fp32 and handed back the dtype it was given
torch.bfloat16
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.policy import cast_floating

_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def fp32_island(device_type: str | None = None) -> Iterator[None]:
    """Autocast off inside (for ``device_type``, or for CPU and CUDA when None).

    Inputs keep their dtype: cast 16-bit tensors up yourself (``h.float()``).
    """
    types = (device_type,) if device_type else tuple(d for d in _AUTOCAST_DEVICES if torch.amp.is_autocast_available(d))
    with contextlib.ExitStack() as stack:
        for t in types:
            stack.enter_context(torch.autocast(t, enabled=False))
        yield


def _first_tensor(obj: Any, floating: bool = False) -> torch.Tensor | None:
    """The first tensor (floating-point only, if asked) in a nest of lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return obj if not floating or obj.is_floating_point() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        t = _first_tensor(item, floating)
        if t is not None:
            return t
    return None


class Fp32Island:
    """What makes a module an fp32 island. Installed by ``keep_fp32``.

    The module's instance ``forward`` becomes an ``_IslandForward``: it casts floating inputs to
    fp32, runs the module's own forward (for a module that is not a built-in norm, with autocast
    off), and casts floating outputs back to the 16-bit dtype the module received. ``detach``
    puts the module's forward back.
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type
        self._wrapper: _IslandForward | None = None

    def attach(self, module: nn.Module) -> "Fp32Island":
        # A norm whose forward has no op autocast lowers computes in fp32 once its inputs are fp32:
        # the casts are enough, and leave autocast alone.
        self._wrapper = _IslandForward(self, module, module.__dict__.get("forward"),
                                       autocast_off=type(module) not in _AUTOCAST_NEUTRAL)
        module.forward = self._wrapper  # type: ignore[method-assign]
        module._mixprec_island = self  # type: ignore[attr-defined]
        return self

    def detach(self, module: nn.Module) -> None:
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is not None and module.__dict__.get("forward") is wrapper:
            if wrapper.inner is None:
                del module.forward
            else:
                module.forward = wrapper.inner  # type: ignore[method-assign]
        if getattr(module, "_mixprec_island", None) is self:
            del module._mixprec_island  # type: ignore[attr-defined]

    def device_of(self, args: Any, kwargs: Any) -> str | None:
        if self.device_type:
            return self.device_type
        first = _first_tensor((args, kwargs))
        return first.device.type if first is not None else None


_SIXTEEN = (torch.float16, torch.bfloat16)


class _IslandForward:
    """An island module's instance ``forward`` (see ``Fp32Island``).

    ``inner`` is an instance ``forward`` the module already had (else the class's is called).
    ``__wrapped__`` lets ``inspect.signature(module.forward)`` see the real parameters.
    """

    def __init__(self, island: Fp32Island, module: nn.Module, inner: Callable[..., Any] | None,
                 autocast_off: bool = True) -> None:
        self.island, self.module, self.inner, self.autocast_off = island, module, inner, autocast_off

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # computed on access: a stored bound method would pickle as getattr(module, "forward"),
        # which after unpickling is this wrapper again
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the common call, norm(x): one floating tensor and nothing else, without the tree walks
        simple = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
        if simple and not self.autocast_off and args[0].dtype == torch.float32:
            return self._run(args, kwargs)  # a built-in norm given fp32 computes in fp32, autocast or not
        first = args[0] if simple else _first_tensor((args, kwargs), floating=True)
        device_type = self.island.device_type or (
            first.device.type if first is not None else self.island.device_of(args, kwargs))
        active = bool(device_type) and torch.is_autocast_enabled(device_type)
        # The output goes back to what autocast would have handed the next op: the 16-bit dtype
        # the input came in, else whatever the module returns.
        back = first.dtype if first is not None and first.dtype in _SIXTEEN else None
        if back is not None or active:
            if simple:
                if first.dtype != torch.float32:  # (an fp32 input, the common case, needs no call)
                    args = (first.to(torch.float32),)  # type: ignore[union-attr]
            else:
                args, kwargs = cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)
        if active and self.autocast_off:
            with torch.autocast(device_type, enabled=False):  # type: ignore[arg-type]
                out = self._run(args, kwargs)
        else:
            out = self._run(args, kwargs)
        if back is None or out is None:
            return out
        return out.to(back) if isinstance(out, torch.Tensor) and out.is_floating_point() else cast_floating(out, back)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


# Norm classes (exact types, not subclasses: a subclass may add a matmul) whose forward runs no op
# on autocast's lower-precision list (matmul, linear, conv, ...) on any device: given fp32 inputs
# they compute in fp32 with autocast on or off.
_AUTOCAST_NEUTRAL: frozenset[type] = frozenset(
    t
    for t in (
        nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)

# torch's norm classes. RMSNorm exists in torch >= 2.4.
_TORCH_NORMS: tuple[type, ...] = tuple(
    t
    for t in (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*
        getattr(nn, "RMSNorm", None),
        nn.LocalResponseNorm,
    )
    if t is not None
)

# A class name that says "norm" at its end: LayerNorm, RMSNorm, LlamaRMSNorm, T5LayerNorm,
# LayerNorm2d, GroupNorm32, FusedLayerNorm, LayerNormalization...
_NORM_NAME = re.compile(r"norm(?:alization)?(?:\d+d?)?$", re.IGNORECASE)


def is_norm(module: nn.Module) -> bool:
    """The ``"norms"`` family: is ``module`` a normalisation layer?

    The rule: an instance of one of torch's norm classes (``LayerNorm``, ``GroupNorm``,
    ``BatchNorm*``, ``InstanceNorm*``, ``RMSNorm``, ``LocalResponseNorm``), or a module whose class
    (or a base class) is named like one, ending in ``Norm`` / ``Normalization`` with an optional
    size suffix (``LlamaRMSNorm``, ``T5LayerNorm``, ``LayerNorm2d``), as most models write their
    own, provided it holds no parameter of 2 or more dimensions: a norm scales and shifts per
    channel; a class named so that holds a matmul weight (an adaptive norm with a projection) is
    not one.
    """
    if isinstance(module, _TORCH_NORMS):
        return True
    named = any(_NORM_NAME.search(c.__name__) for c in type(module).__mro__ if c not in (nn.Module, object))
    return named and all(p.dim() <= 1 for p in module.parameters())


def looks_like_norm(module: nn.Module) -> bool:
    """A module the ``"norms"`` rule does not take but that plainly may be one (for a warning):
    'norm' somewhere in its class name, or a leaf whose only parameters are a 1-D ``weight`` (and
    ``bias``) of one length, as an affine normalisation holds."""
    if is_norm(module) or type(module).__module__.startswith("torch."):  # torch's own classes are known
        return False
    if "norm" in type(module).__name__.lower():
        return True
    params = dict(module.named_parameters(recurse=False))
    if next(module.children(), None) is not None or "weight" not in params or set(params) - {"weight", "bias"}:
        return False
    return all(p.dim() == 1 and p.numel() == params["weight"].numel() for p in params.values())


# Module families a recipe can name: family -> predicate on a module.
_FAMILIES: dict[str, Callable[[nn.Module], bool]] = {"norms": is_norm}
FAMILIES = tuple(_FAMILIES)

Rule = str | type | Callable[[str, nn.Module], bool]


def module_matches_rule(name: str, module: nn.Module, rule: Rule) -> bool:
    """Does ``module`` (qualified ``name``) match one rule item?

    A rule item is a family (``"norms"``), a module class, a class name (``"LayerNorm"``), a
    qualified module name (``"head"`` or ``"blocks.0.attn"``), or a predicate ``(name, module) -> bool``.
    """
    if isinstance(rule, type):
        return isinstance(module, rule)
    if callable(rule):
        return bool(rule(name, module))
    if rule in _FAMILIES:
        return _FAMILIES[rule](module)
    return name == rule or type(module).__name__ == rule


def as_rules(rules: Any) -> list[Any]:
    """A list of rule items from one item (a name, a class, a predicate) or a sequence of them: a
    lone string is one rule, not letters (for ``keep_fp32``, ``fp32_modules`` and ``fp32_params``)."""
    if isinstance(rules, (str, type)) or callable(rules):
        return [rules]
    return list(rules)


def keep_fp32(
    model: nn.Module,
    rules: Sequence[Rule] | Rule,
    device_type: str | None = None,
) -> list[str]:
    """Make every submodule matching ``rules`` an fp32 island; returns their qualified names.

    A module inside an island is not made an island again (the outer one already covers it).
    Raises ValueError if a name in ``rules`` matches nothing (a typo would otherwise pass silently);
    warns when a class or a predicate matches nothing, or the ``"norms"`` family misses a likely norm.
    """
    rules = as_rules(rules)
    modules = list(model.named_modules())  # pre-order: parents before children
    hits = [{i for i, r in enumerate(rules) if module_matches_rule(n, m, r)} for n, m in modules]
    matched = set().union(*hits)
    for i, r in enumerate(rules):
        if isinstance(r, str) and r not in _FAMILIES and i not in matched:
            raise ValueError(
                f"fp32 island rule {r!r} matches no submodule name or class of {type(model).__name__}; "
                f"use a qualified name from model.named_modules(), a class (name), or one of {sorted(_FAMILIES)}"
            )
    for i, r in enumerate(rules):
        if r == "norms" and i not in matched:
            warn_unmatched_norms(model, "fp32 islands")
        elif not isinstance(r, str) and i not in matched:  # a class or a predicate: said, not raised
            what = f"class {r.__module__}.{r.__qualname__}" if isinstance(r, type) else f"predicate {r!r}"
            warnings.warn(
                f"fp32 island rule ({what}) matches no submodule of {type(model).__name__}: it makes no island. "
                "Check the class (the same class object the model uses) or the predicate's (name, module) test",
                UserWarning, stacklevel=2,
            )
    chosen: list[str] = []  # islands that match the rules (made now or earlier)
    covered: list[str] = []  # every island: modules inside one need no island of their own
    for (name, module), hit in zip(modules, hits):
        if any(c == "" or name.startswith(c + ".") for c in covered):
            continue
        if getattr(module, "_mixprec_island", None) is None and hit:
            Fp32Island(device_type).attach(module)
        if getattr(module, "_mixprec_island", None) is not None:
            covered.append(name)
            if hit:
                chosen.append(name)
    return chosen


def warn_unmatched_norms(model: nn.Module, what: str) -> None:
    """Warn when the ``"norms"`` family matched nothing in ``model`` but some modules look like norms."""
    suspects = [(n, type(m).__name__) for n, m in model.named_modules() if n and looks_like_norm(m)]
    if not suspects:
        return
    classes = sorted({c for _, c in suspects})
    shown = ", ".join(f"{n} ({c})" for n, c in suspects[:4]) + ("..." if len(suspects) > 4 else "")
    warnings.warn(
        f"the 'norms' rule ({what}) matched no module of {type(model).__name__}, but these look like "
        f"norms: {shown}. If they normalise, name them: fp32_modules={classes!r} (islands) and, for the "
        f"16-bit storage recipes, fp32_params={['norms', 'biases', 'embeddings', 'bare', *classes]!r}",
        UserWarning, stacklevel=3,
    )


def family_matches(model: nn.Module, family: str) -> dict[str, int]:
    """Class name -> how many of ``model``'s modules the family (``"norms"``) matches."""
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        if name and _FAMILIES[family](m):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


def remove_fp32_islands(model: nn.Module) -> int:
    """Undo ``keep_fp32``; returns how many islands were removed."""
    n = 0
    for module in model.modules():
        island = getattr(module, "_mixprec_island", None)
        if island is not None:
            island.detach(module)
            n += 1
    return n


def island_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "_mixprec_island", None) is not None]


# ---------------------------------------------------------------- norms with fp32 statistics


def _fp32_params(*params: torch.Tensor | None) -> Iterable[torch.Tensor | None]:
    return (None if p is None else p.float() for p in params)


class Fp32LayerNorm(nn.LayerNorm):
    """LayerNorm whose mean and variance are computed in fp32; returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = _fp32_params(self.weight, self.bias)
        with fp32_island(x.device.type):
            y = nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return y.to(x.dtype)


class Fp32GroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics are computed in fp32; returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = _fp32_params(self.weight, self.bias)
        with fp32_island(x.device.type):
            y = nn.functional.group_norm(x.float(), self.num_groups, w, b, self.eps)
        return y.to(x.dtype)


class Fp32RMSNorm(nn.Module):
    """RMSNorm (``x / sqrt(mean(x^2) + eps) * weight``) with the mean square in fp32."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6, elementwise_affine: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape = shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        with fp32_island(x.device.type):
            x32 = x.float()
            y = x32 * torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + self.eps)
            if self.weight is not None:
                y = y * self.weight.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"
