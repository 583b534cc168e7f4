"""Cast a trained fp32 model for inference in bf16 or fp16, with the training recipes' fp32 rules.

Two modes, both running the forward under ``torch.autocast(dtype)`` (set up by the model itself,
and by each submodule called on its own, so ``model(x)``, ``model.generate(...)`` and
``model.model(...)`` need no context around them):

- ``"storage"`` (the default, what a deployment does): parameters stored in 16 bits, smaller by
  about half; the ones the 16-bit storage recipe (``bf16-true`` / ``fp16-true``) keeps in fp32
  stay fp32 (``mixprec.masters.rules.fp32_param_names`` with that recipe's ``fp32_params``).
- ``"autocast"``: parameters stay fp32 and autocast casts them per op, as the mixed recipes
  (``bf16-mixed`` / ``fp16-mixed``) compute.

In both, the modules the recipe keeps as fp32 islands (its ``fp32_modules``: the ``"norms"``
family) become islands (``mixprec.islands.keep_fp32``): their statistics are computed in fp32.
Which modules count as norms is the islands' rule, not this module's. Buffers (BatchNorm's running
statistics, rotary frequencies) are left as they are.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
>>> lp = cast_for_inference(net, "bf16")
>>> [p.dtype for p in lp.parameters()]  # the Linear's weight in bf16; its bias and the norm fp32
[torch.bfloat16, torch.float32, torch.float32, torch.float32]
>>> lp(torch.randn(2, 4)).dtype
torch.bfloat16
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format, short_name
from mixprec.islands import Rule, as_rules, island_names, keep_fp32
from mixprec.masters.rules import fp32_param_names
from mixprec.recipes import Recipe, get_recipe

MODES = ("storage", "autocast")
#: (mode, dtype) -> the training recipe whose fp32 rules the cast reuses
_RECIPES = {
    ("storage", torch.bfloat16): "bf16-true",
    ("storage", torch.float16): "fp16-true",
    ("autocast", torch.bfloat16): "bf16-mixed",
    ("autocast", torch.float16): "fp16-mixed",
}


#: the command's spelling of the two dtypes
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16`` / ``fp16`` (``mixprec.formats`` says ``f16``; the command and its users say ``fp16``)."""
    return NAMES.get(dtype) or short_name(dtype)


def inference_dtype(spec: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"fp16"`` (any spelling ``mixprec.formats`` accepts) -> the torch dtype."""
    try:
        fmt = get_format(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"inference dtype {spec!r}: {e}; use bf16 or fp16") from None
    if fmt.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"inference dtype {spec!r} is {fmt.name}; low-precision inference casts to bf16 or fp16")
    return fmt.dtype


def recipe_for(dtype: str | torch.dtype, mode: str = "storage") -> Recipe:
    """The training recipe whose fp32 islands (and, for storage, fp32 parameters) a cast reuses."""
    if mode not in MODES:
        raise ValueError(f"inference mode {mode!r}; expected one of {', '.join(MODES)}")
    return get_recipe(_RECIPES[(mode, inference_dtype(dtype))])


@dataclasses.dataclass(frozen=True)
class CastInfo:
    """What ``cast_for_inference`` did to a model (``model._mixprec_inference``).

    Attributes:
        dtype, mode: the 16-bit dtype and ``"storage"`` / ``"autocast"``.
        recipe: the training recipe whose rules were applied.
        islands: qualified names of the modules made fp32 islands.
        fp32_params: parameters left in fp32 (every floating one in autocast mode).
        params: floating parameters in all (tied ones once).
        bytes_fp32, bytes_now: bytes of the parameters before and after the cast.
    """

    dtype: torch.dtype
    mode: str
    recipe: str
    islands: tuple[str, ...]
    fp32_params: tuple[str, ...]
    params: int
    bytes_fp32: int
    bytes_now: int

    def describe(self) -> str:
        name = dtype_name(self.dtype)
        if self.mode == "autocast":
            stored = f"parameters fp32, cast per op, {_mb(self.bytes_now)}"
        else:
            stored = (f"{len(self.fp32_params)}/{self.params} tensors kept fp32, "
                      f"{_mb(self.bytes_fp32)} -> {_mb(self.bytes_now)}")
        return f"{name} {self.mode} ({self.recipe}'s rules): {stored}, {len(self.islands)} fp32 islands"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "mode": self.mode, "recipe": self.recipe,
                "islands": list(self.islands), "fp32_params": list(self.fp32_params), "params": self.params,
                "bytes_fp32": self.bytes_fp32, "bytes": self.bytes_now}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _LowPrecisionForward:
    """The cast model's instance ``forward``: its own forward under ``torch.autocast(dtype)``.

    ``inner`` is an instance ``forward`` the model already had (an island's wrapper when the model
    itself is an island), else the class's is called. ``__wrapped__`` lets
    ``inspect.signature(model.forward)`` (which Hugging Face's ``generate`` reads) see the real one.
    The submodules' (``nested``) enter autocast only when it is not on in ``dtype`` already: called
    from the model's forward they cost one check, called on their own (``model.model``,
    ``model.get_encoder()``, a backbone) they compute in ``dtype`` as they do inside the model,
    rather than in fp32 (autocast mode) or failing on 16-bit weights (storage mode).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, inner: Callable[..., Any] | None,
                 nested: bool = False) -> None:
        self.module, self.dtype, self.inner, self.nested = module, dtype, inner, nested

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # computed on access, so that pickling or copying the model does not store a bound method
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def device_type(self, args: tuple, kwargs: dict) -> str:
        for p in self.module.parameters():
            return p.device.type
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                return t.device.type
        return "cpu"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = self.device_type(args, kwargs)
        if self.nested and torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == self.dtype:
            return self._run(args, kwargs)
        with torch.autocast(device_type, dtype=self.dtype):
            return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def _wrap_submodules(model: nn.Module, dtype: torch.dtype, islands: Sequence[str]) -> None:
    """A nested ``_LowPrecisionForward`` on each submodule with a forward of its own and a floating
    parameter in or below it, outside the fp32 islands (an island and what it calls stay fp32)."""
    if "" in islands:  # the model itself is an island
        return
    for name, module in model.named_modules():
        if module is model or type(module).forward is nn.Module.forward:
            continue
        if any(name == i or name.startswith(i + ".") for i in islands):
            continue
        if any(p.is_floating_point() for p in module.parameters()):
            module.forward = _LowPrecisionForward(module, dtype, module.__dict__.get("forward"),  # type: ignore[method-assign]
                                                  nested=True)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"cast_for_inference takes an nn.Module, got {type(model).__name__}")
    if getattr(model, "_mixprec_inference", None) is not None:
        raise ValueError("this model was already cast for inference; cast the fp32 model it came from")
    recipe = getattr(model, "_mixprec_recipe", None)
    if recipe is not None:
        raise ValueError(
            f"this model was prepared for training with recipe {recipe!r} (fp32 islands, hooks, maybe 16-bit "
            "storage); build a fresh model, load the trained fp32 weights into it and cast that"
        )
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"parameter {name!r} is stored in {short_name(p.dtype)}; cast_for_inference starts from the fp32 "
                "model (call model.float() first: lossless from bf16/fp16) and applies the fp32 rules itself"
            )


def cast_for_inference(
    model: nn.Module,
    dtype: str | torch.dtype = "bf16",
    *,
    mode: str = "storage",
    fp32_modules: Sequence[Rule] | Rule | None = None,
    fp32_params: Sequence[Any] | None = None,
    inplace: bool = False,
) -> nn.Module:
    """The fp32 ``model``, cast for inference in ``dtype`` (``"bf16"`` or ``"fp16"``), in eval mode.

    Args:
        model: a trained fp32 model (every floating parameter fp32).
        dtype: the 16-bit dtype.
        mode: ``"storage"`` (parameters in 16 bits, except the storage recipe's fp32 parameters)
            or ``"autocast"`` (parameters fp32). Both run the forward under autocast.
        fp32_modules: fp32 island rules (``mixprec.islands.keep_fp32``); default the recipe's
            (``("norms",)``). ``()`` for none.
        fp32_params: storage mode only: which parameters stay fp32 (``mixprec.masters.rules``
            items); default the storage recipe's (norms, biases, embeddings, bare). ``()`` stores every
            floating parameter in 16 bits (the norms then compute in fp32 with 16-bit weights).
        inplace: cast ``model`` itself instead of a deep copy of it.

    Returns the cast model (``model`` itself when ``inplace``); ``model._mixprec_inference`` is a
    ``CastInfo`` saying what was done. Raises ValueError for a model that is not plain fp32 (cast
    already, prepared for training, or holding 16-bit parameters).
    """
    dt = inference_dtype(dtype)
    recipe = recipe_for(dt, mode)
    if mode == "autocast" and fp32_params is not None:
        raise ValueError("fp32_params applies to mode='storage' (in autocast mode every parameter stays fp32)")
    _check_model(model)
    bytes_fp32 = _param_bytes(model)
    out = model if inplace else copy.deepcopy(model)
    out.eval()
    rules = recipe.fp32_modules if fp32_modules is None else as_rules(fp32_modules)
    device_type = next((p.device.type for p in out.parameters()), None)
    keep_fp32(out, list(rules), device_type)
    floating = [(n, p) for n, p in out.named_parameters() if p.is_floating_point()]
    if mode == "storage":
        kept = fp32_param_names(out, list(recipe.fp32_params if fp32_params is None else fp32_params))
        keep = set(kept)
        with torch.no_grad():
            for n, p in floating:
                if n not in keep:
                    p.data = p.data.to(dt)  # the same Parameter object: tied weights stay tied
    else:
        kept = [n for n, _ in floating]
    islands = island_names(out)
    _wrap_submodules(out, dt, islands)
    out.forward = _LowPrecisionForward(out, dt, out.__dict__.get("forward"))  # type: ignore[method-assign]
    info = CastInfo(dt, mode, recipe.name, tuple(islands), tuple(kept), len(floating), bytes_fp32,
                    _param_bytes(out))
    out._mixprec_inference = info  # type: ignore[attr-defined]
    return out


def cast_info(model: nn.Module) -> CastInfo | None:
    """What ``cast_for_inference`` did to ``model`` (None for a model it did not make)."""
    return getattr(model, "_mixprec_inference", None)
