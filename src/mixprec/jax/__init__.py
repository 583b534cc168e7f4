"""mixprec.jax: jmp's API with its known bugs fixed, plus mixprec's recipes, an optax wrapper and the tools.

A drop-in for jmp (``import mixprec.jax as jmp``): ``Policy``, ``get_policy``, ``half_dtype``,
``cast_to_full``, ``cast_to_half``, ``NoOpLossScale``, ``StaticLossScale``, ``DynamicLossScale``,
``LossScale``, ``all_finite``, ``select_tree``, laid out as jmp lays them out
(``mixprec.jax.policy`` and ``mixprec.jax.loss_scale`` are jmp's ``_src.policy`` and
``_src.loss_scale``). Beyond jmp (imported on first use):

- ``get_recipe("fp16-mixed")``: the torch side's recipe names as a policy plus a loss scale;
- ``skip_nonfinite(optax.adamw(3e-4), recipe)``: unscale, check, adjust the scale and commit or
  skip the step inside one jitted update, counting skipped steps;
- ``probe_grad_underflow(grads)``: where a gradient pytree would land in fp16/bf16/fp8;
- ``save_tree`` / ``load_tree``: checkpoints of any of these pytrees that resume bit for bit;
- ``compare``: the JAX twin of ``mixprec compare`` (``mixprec compare --backend jax``).

See docs/jax.md. Needs the ``jax`` extra: ``pip install 'mixprec[jax]'``.
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

try:
    import jax.numpy as _jnp  # noqa: F401  (a submodule: a stray directory named jax would pass "import jax")
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the packaging test
    raise ImportError(
        "mixprec.jax needs jax (and optax for its optimizer wrapper), which are not installed: "
        "pip install 'mixprec[jax]' (or pip install jax jaxlib optax)"
    ) from e

from mixprec.jax.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from mixprec.jax.policy import Policy, cast_to_full, cast_to_half, dtype_to_names, get_policy, half_dtype

from mixprec import __version__ as __version__  # noqa: E402  (mixprec.jax.__version__ is mixprec's)
from mixprec.jax.flax_support import register as _register_flax_serialization

_register_flax_serialization()  # flax.serialization handlers for the state classes, when flax is installed

# beyond jmp: name -> module, imported on first use (the recipes and tools import torch-side modules)
_LAZY: dict[str, str] = {
    "JaxRecipe": "mixprec.jax.recipes",
    "get_recipe": "mixprec.jax.recipes",
    "recipe_names": "mixprec.jax.recipes",
    "skip_nonfinite": "mixprec.jax.optim",
    "SkipNonFiniteState": "mixprec.jax.optim",
    "Accumulation": "mixprec.jax.optim",
    "loss_scale_of": "mixprec.jax.optim",
    "skipped_steps_of": "mixprec.jax.optim",
    "probe_grad_underflow": "mixprec.jax.probes",
    "save_tree": "mixprec.jax.checkpoint",
    "load_tree": "mixprec.jax.checkpoint",
    "JaxTask": "mixprec.jax.tasks",
    "compare": "mixprec.jax.comparison",
    "cast_to_compute_varying": "mixprec.jax.parallel",
    "audit": "mixprec.jax.auditing",
    "AuditReport": "mixprec.jax.auditing",
}

__all__ = (
    "all_finite",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "select_tree",
    "StaticLossScale",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "Policy",
    "dtype_to_names",
    *sorted(_LAZY),
)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
