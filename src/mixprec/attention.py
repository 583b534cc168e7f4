"""Attention under 16-bit autocast in fp32, where that is faster or asked for: ``Recipe.attention``.

- ``"recipe"`` (every named recipe's default): attention runs as the recipe computes it.
- ``"fp32"``: every ``F.scaled_dot_product_attention`` call in a prepared model's forward that would
  run in 16 bits runs on fp32 copies of q, k and v outside autocast, and its output is cast back to
  the 16-bit dtype: an fp32 island around the attention product (docs/bench.md), for a function
  the module rules cannot name.
- ``"fastest"`` (``auto``'s, on a CPU that computes bf16): per call shape, whichever of the two this
  machine runs faster, measured once per shape and machine and cached (``mixprec.autotune``).

How: the model's instance ``forward`` enters a ``TorchFunctionMode`` that sees each torch call of
the forward (about a microsecond each; the attention product is the only one it changes) and leaves
it when the forward returns. Backward needs nothing: the casts are differentiable, so the product's
backward runs in fp32 too. The numbers differ from the 16-bit product's by its rounding: fp32 is the
more exact of the two (tests/test_attention.py, against float64).

Only ``F.scaled_dot_product_attention`` is routed. A model whose 16-bit forward calls none (eager
attention written with matmul and softmax, Hugging Face's ``attn_implementation="eager"``) keeps
its attention as the recipe computes it: ``"fp32"`` then warns once, and ``mp.describe()`` says so
(checked in eager forwards; a compiled forward is not watched).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

MODES = ("recipe", "fp32", "fastest")
_SDPA = F.scaled_dot_product_attention
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def check_mode(value: Any) -> str:
    if value not in MODES:
        raise ValueError(f"attention={value!r} is not one of {', '.join(MODES)}: 'recipe' runs attention as the recipe "
                         "computes it, 'fp32' on fp32 copies of q, k, v, 'fastest' whichever this machine runs faster "
                         "(measured once per shape, cached)")
    return value


def with_attention(recipe: Any, attention: str | None) -> Any:
    """``recipe`` with its ``attention`` set (None: as it is)."""
    if attention is None:
        return recipe
    return dataclasses.replace(recipe, attention=check_mode(attention))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, mask: Any, dropout: float,
              causal: bool, gqa: bool) -> tuple:
    """What an attention call's speed depends on: its 16-bit dtype, batch and lengths (rounded up to
    powers of two: a cache entry per bucket, not per length), heads, head sizes, mask, causality."""
    batch = _pow2(q[..., 0, 0, 0].numel()) if q.dim() > 3 else 1
    kind = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return (str(dtype).removeprefix("torch."), batch, q.shape[-3] if q.dim() > 2 else 1, k.shape[-3] if k.dim() > 2 else 1,
            _pow2(q.shape[-2]), _pow2(k.shape[-2]), q.shape[-1], v.shape[-1], bool(causal), kind, dropout > 0, bool(gqa))


class _AttentionMode(TorchFunctionMode):
    def __init__(self, owner: "AttentionForward") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not _SDPA:
            owner = self.owner
            if owner.watching and not owner.sixteen and not torch.compiler.is_compiling():  # (until a product is seen)
                owner.sixteen = torch.is_autocast_enabled(owner.device.type) and torch.get_autocast_dtype(
                    owner.device.type) in (torch.bfloat16, torch.float16)
            return func(*args, **(kwargs or {}))
        return self.owner.attend(func, args, kwargs or {})


class AttentionForward:
    """A prepared model's instance ``forward``: the model's own, with the attention product routed
    as ``Recipe.attention`` says (``"fp32"`` or ``"fastest"``)."""

    def __init__(self, module: nn.Module, policy: str, device: torch.device) -> None:
        self.inner = module.__dict__.get("forward")  # an instance forward someone set before us
        self.module, self.policy, self.device = module, check_mode(policy), device
        self.choices: dict[tuple, str] = {}  # signature -> "fp32" / "recipe", as decided
        self.calls = {"fp32": 0, "recipe": 0}
        # Until a 16-bit product is seen: a 16-bit forward without one (eager attention written
        # with matmul and softmax, a custom kernel) leaves the attention as the recipe computes it:
        # said (a warning for "fp32", and in describe()), never passed off as fp32 attention.
        self.watching, self.missed = True, 0
        self.sixteen = False  # did this forward run a torch call under 16-bit autocast? (while watching)

    def _forward_ended(self) -> None:
        if not self.watching or not self.sixteen or sum(self.calls.values()):
            return
        self.missed += 1
        if self.policy == "fp32" and self.missed == 1:
            import warnings

            warnings.warn(
                f"mixprec: attention='fp32' was asked for, but a 16-bit forward of {type(self.module).__name__} "
                "called no F.scaled_dot_product_attention: its attention (eager matmul and softmax, or a custom "
                "kernel) runs as the recipe computes it, not in fp32. Use an SDPA attention (Hugging Face: "
                "attn_implementation='sdpa'), or make the attention modules fp32 islands (fp32_modules=[...])",
                UserWarning, stacklevel=3)

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(model.forward) sees the model's own
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.watching or torch.compiler.is_compiling():  # (a compiled graph is not watched)
            with _AttentionMode(self):
                return self.__wrapped__(*args, **kwargs)
        self.sixteen = False
        with _AttentionMode(self):
            out = self.__wrapped__(*args, **kwargs)
        self._forward_ended()
        return out

    def attend(self, func: Any, args: tuple, kwargs: dict) -> Any:
        bound = dict(zip(_ARGS, args), **kwargs)
        q = bound.get("query")
        device_type = q.device.type if isinstance(q, torch.Tensor) else self.device.type
        low = None
        if torch.is_autocast_enabled(device_type):
            low = torch.get_autocast_dtype(device_type)
        elif isinstance(q, torch.Tensor) and q.dtype in (torch.bfloat16, torch.float16):
            low = q.dtype
        if low not in (torch.bfloat16, torch.float16) or not isinstance(q, torch.Tensor):
            return func(*args, **kwargs)
        self.watching = False
        choice = "fp32"
        if self.policy == "fastest":
            sig = signature(q, bound["key"], bound["value"], low, bound.get("attn_mask"),
                            float(bound.get("dropout_p") or 0.0), bool(bound.get("is_causal")), bool(bound.get("enable_gqa")))
            choice = self.choices.get(sig)
            if choice is None:
                from mixprec.autotune import attention_choice

                choice = self.choices[sig] = attention_choice(sig, q.device)
        self.calls[choice] += 1
        if choice != "fp32":
            return func(*args, **kwargs)
        fp32 = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in bound.items()}
        with torch.autocast(device_type, enabled=False):
            out = func(**fp32)
        return out.to(low)

    def describe(self) -> str:
        if self.watching and self.missed:
            return (f"attention: {self.policy} asked, but {self.missed} 16-bit forward(s) called no "
                    "F.scaled_dot_product_attention: attention ran as the recipe computes it")
        if self.policy == "fp32":
            return "attention: fp32 (F.scaled_dot_product_attention on fp32 copies of q, k, v)"
        if not self.choices:
            return "attention: fastest of fp32 and 16-bit, measured per shape at its first call (none yet)"
        fp32 = sum(c == "fp32" for c in self.choices.values())
        return (f"attention: fastest of fp32 and 16-bit, measured per shape: fp32 for {fp32} of "
                f"{len(self.choices)} shape(s) met")


def install(model: nn.Module, recipe: Any, device: torch.device) -> AttentionForward | None:
    """Route ``model``'s attention as ``recipe.attention`` says (nothing to do for "recipe", or for a
    recipe that computes in fp32)."""
    policy = getattr(recipe, "attention", "recipe")
    if policy == "recipe" or not recipe.autocast or recipe.compute_dtype == torch.float32:
        return None
    wrapper = AttentionForward(model, policy, device)
    model.forward = wrapper  # type: ignore[method-assign]
    return wrapper
