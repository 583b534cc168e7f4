"""The torch side's recipe names, for JAX: a ``Policy`` plus a loss scale.

``mixprec.recipes`` is the one place that knows recipe names; this module asks it and translates
the answer: the policy's dtypes onto jax dtypes, ``loss_scaling`` onto a jmp-style loss scale
(``dynamic``: ``DynamicLossScale`` starting at torch GradScaler's 2^16, period 2000, factor 2;
``static``: ``StaticLossScale``; ``none``: ``NoOpLossScale``).

What a recipe means in JAX, where parameters are a pytree and nothing is cast behind your back:
the optimizer owns fp32 parameters (the master copy) and the step casts them at the boundary:
``policy.cast_to_compute((params, x))`` in, ``policy.cast_to_output(y)`` out, the loss in fp32.
Gradients come back in fp32 because the casts are traced ops. A ``-true`` recipe (16-bit storage
with fp32 masters, ``master="fp32"``) therefore trains exactly like its ``-mixed`` twin here; its
``policy.param_dtype`` says what the stored model is (``cast_to_param`` gives that copy, e.g. to
export). The torch-only storage schemes (Kahan, stochastic rounding, int16 remainders) and the
unsafe ``-pure`` baselines (16-bit parameters without a master) are refused.

The fp8 recipes (``fp8-current``, ``fp8-delayed``, the unsafe ``fp8-unscaled``) are bf16-mixed plus
fp8 dots: ``recipe.fp8`` is their ``mixprec.jax.fp8.Fp8Config``, and a forward computes its matmuls
in fp8 through ``recipe.dot_general`` / ``recipe.matmul`` (plain ``lax.dot_general`` / ``x @ w`` under
every other recipe) or through the Flax layers of ``mixprec.jax.fp8``. The policy alone is
bf16-mixed's: a forward that multiplies with ``@`` does not compute in fp8 (``compare`` refuses such
a task for an fp8 recipe rather than run bf16 under the fp8 name).

>>> r = get_recipe("fp16-mixed")
>>> str(r.policy), type(r.loss_scale()).__name__
('p=full,c=f16,o=full', 'DynamicLossScale')
>>> get_recipe("p=f32,c=bf16,o=f32").name
'p=f32,c=bf16,o=f32'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixprec.jax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from mixprec.jax.policy import Policy, _FORMAT_TO_JAX, cast_to_full, dtype_name as dtype_label

#: torch GradScaler's defaults, which the torch side's dynamic recipes use
INIT_SCALE = 2.0**16
MASTERS = ("none", "fp32")


@dataclasses.dataclass(frozen=True)
class JaxRecipe:
    """A recipe for JAX: the policy, the loss scaling and what the optimizer updates.

    Attributes:
        name: the torch side's canonical name (``bf16-mixed``) or the policy string.
        policy: param / compute / output dtypes (jax dtypes).
        loss_scaling: ``"none"``, ``"static"`` or ``"dynamic"``.
        master: ``"none"`` (fp32 parameters) or ``"fp32"`` (16-bit model, fp32 master: the
            optimizer's fp32 pytree is the master).
        fp32_norms: the torch recipe keeps norms in fp32; a task's forward can ask this.
        static_scale: the scale of ``static`` recipes.
        description, reason: from the torch recipe.
        fp8: the fp8 recipes' ``mixprec.jax.fp8.Fp8Config`` (None for the others); ``fp8_skip_first_last``
            and ``fp8_exclude`` say which dots of a forward stay bf16 (the torch side's layer rules).
    """

    name: str
    policy: Policy
    loss_scaling: str = "none"
    master: str = "none"
    fp32_norms: bool = False
    static_scale: float = 2.0**16
    description: str = ""
    reason: str = "requested"
    fp8: Any = None
    fp8_skip_first_last: bool = True
    fp8_exclude: tuple[str, ...] = ()
    _fp8_binding: Any = dataclasses.field(default=None, compare=False, repr=False)

    def loss_scale(self, init_scale: float | None = None, **kwargs: Any) -> LossScale:
        """A fresh loss scale for this recipe.

        ``init_scale`` and ``kwargs`` (``period``, ``factor``, ``min_loss_scale``, ``max_loss_scale``,
        ``hysteresis``, ``consecutive_hysteresis``) tune a dynamic one; a static one takes ``init_scale``.
        """
        if self.loss_scaling == "dynamic":
            scale = INIT_SCALE if init_scale is None else init_scale
            if "min_loss_scale" in kwargs:
                kwargs["min_loss_scale"] = np.asarray(kwargs["min_loss_scale"], np.float32)
            if kwargs.get("max_loss_scale") is not None:
                kwargs["max_loss_scale"] = np.asarray(kwargs["max_loss_scale"], np.float32)
            return DynamicLossScale(jnp.float32(scale), **kwargs)
        if kwargs:
            raise ValueError(
                f"recipe {self.name!r} uses {self.loss_scaling} loss scaling; {sorted(kwargs)} tune a dynamic one "
                "(fp16-mixed, fp16-true)"
            )
        if self.loss_scaling == "static":
            return StaticLossScale(np.float32(self.static_scale if init_scale is None else init_scale))
        if init_scale is not None:
            raise ValueError(f"recipe {self.name!r} uses no loss scaling; init_scale={init_scale!r} has nothing to set")
        return NoOpLossScale()

    def prepare_params(self, params: Any) -> Any:
        """The parameters the optimizer owns: fp32 floating leaves (the master copy)."""
        return cast_to_full(params)

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, *, name: str | None = None,
                    precision: Any = None, preferred_element_type: Any = None) -> Any:
        """``lax.dot_general`` as this recipe computes it: from fp8 operands under an fp8 recipe
        (``mixprec.jax.fp8``), plain otherwise. ``name`` identifies the dot for the layer rules and
        delayed scaling's state (default: its position in the forward, ``dot_0``, ``dot_1``, ...)."""
        if self.fp8 is None:
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                       preferred_element_type=preferred_element_type)
        from mixprec.jax.fp8.binding import recipe_dot

        return recipe_dot(self, lhs, rhs, dimension_numbers, name, precision, preferred_element_type)

    def matmul(self, x: Any, w: Any, *, name: str | None = None) -> Any:
        """``x @ w`` for a 2-D ``w`` (a dense layer's kernel), through ``dot_general``."""
        if jnp.ndim(w) != 2 or jnp.ndim(x) < 1:
            raise ValueError(f"recipe.matmul multiplies x (..., K) by a kernel (K, N); got shapes {jnp.shape(x)} and "
                             f"{jnp.shape(w)} (use recipe.dot_general for other contractions)")
        return self.dot_general(x, w, (((jnp.ndim(x) - 1,), (0,)), ((), ())), name=name)

    @property
    def same_as(self) -> str | None:
        """The recipe this one computes exactly like in JAX: a ``-true`` recipe (fp32 master, 16-bit model) is
        its ``-mixed`` twin here, since the optimizer's fp32 pytree is the master and the cast happens in the
        step (``"bf16-mixed"`` for ``bf16-true``); None for the others."""
        if self.master != "fp32":
            return None
        return {"bf16": "bf16-mixed", "f16": "fp16-mixed"}.get(dtype_label(self.policy.compute_dtype))

    @property
    def is_mixed(self) -> bool:
        return jnp.dtype(self.policy.compute_dtype).itemsize < jnp.dtype(jnp.float32).itemsize


def _jax_dtype(torch_dtype: Any) -> Any:
    from mixprec.formats import get_format

    return _FORMAT_TO_JAX[get_format(torch_dtype).name]


def _device_kind() -> str:
    return jax.default_backend()


def _resolve_torch(name: str) -> Any:
    from mixprec import recipes

    key = name.strip().lower()
    if key != "auto":
        return recipes.resolve_recipe(name, "cpu")
    backend = _device_kind()
    if backend == "tpu":
        return dataclasses.replace(recipes.get_recipe("bf16-mixed"), reason="auto: TPUs compute bf16 natively")
    if backend == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", None)
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            major = 0
        if major >= 8:
            return dataclasses.replace(recipes.get_recipe("bf16-mixed"),
                                       reason=f"auto: GPU compute capability {cc} computes bf16 natively")
        return dataclasses.replace(recipes.get_recipe("fp16-mixed"),
                                   reason=f"auto: GPU compute capability {cc} has no native bf16 (needs 8.0+)")
    return recipes.resolve_recipe("auto", "cpu")  # the torch side's CPU rule reads the same CPU flags


def get_recipe(name: str | JaxRecipe) -> JaxRecipe:
    """A recipe by the torch side's names (``fp32``, ``bf16-mixed``, ``fp16-mixed``, ``bf16-true``,
    ``fp16-true``, their aliases, ``auto``) or a jmp policy string (``"p=f32,c=bf16,o=f32"``).

    Raises ``ValueError`` for unknown names (listing the accepted ones) and for recipes whose
    storage scheme exists only on the torch side.
    """
    if isinstance(name, JaxRecipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get_recipe expects a recipe name such as 'bf16-mixed', got {type(name).__name__}")
    try:
        torch_recipe = _resolve_torch(name)
    except ValueError as e:
        raise ValueError(f"{e} (mixprec.jax runs: {', '.join(recipe_names())})") from None
    if torch_recipe.master not in MASTERS:
        raise ValueError(
            f"recipe {torch_recipe.name!r} keeps its master weights as {torch_recipe.master!r}, which only the torch side "
            f"implements; mixprec.jax runs {', '.join(recipe_names())} (and jmp policy strings)"
        )
    p = torch_recipe.policy
    policy = Policy(_jax_dtype(p.param_dtype), _jax_dtype(p.compute_dtype), _jax_dtype(p.output_dtype))
    loss_scaling = torch_recipe.loss_scaling
    if "=" in name:
        from mixprec.jax.policy import get_policy

        # the jmp string read by jmp's rules: 'half' is bf16 on TPU, and then needs no loss scale
        policy = get_policy(name)
        loss_scaling = "dynamic" if jnp.dtype(policy.compute_dtype) == jnp.float16 else "none"
    fp8: dict[str, Any] = {}
    if torch_recipe.fp8 is not None:
        from mixprec.jax.fp8.casts import Fp8Config

        spec = torch_recipe.fp8
        try:
            fp8 = {"fp8": Fp8Config.from_spec(spec), "fp8_skip_first_last": bool(spec.skip_first_last),
                   "fp8_exclude": tuple(spec.exclude)}
        except ValueError as e:
            raise ValueError(f"recipe {torch_recipe.name!r}: {e}") from None
    return JaxRecipe(
        **fp8,
        name=torch_recipe.name,
        policy=policy,
        loss_scaling=loss_scaling,
        master=torch_recipe.master,
        fp32_norms="norms" in torch_recipe.fp32_modules,
        static_scale=float(torch_recipe.static_scale),
        description=torch_recipe.description,
        reason=torch_recipe.reason,
    )


def recipe_names() -> list[str]:
    """The registered recipes mixprec.jax can run (canonical names), plus ``auto``."""
    from mixprec import recipes

    return ["auto"] + [r.name for r in recipes.list_recipes() if r.master in MASTERS]
