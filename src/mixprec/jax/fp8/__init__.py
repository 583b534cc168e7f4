"""fp8 for JAX: the torch side's fp8 numerics (``mixprec.fp8``) as a ``dot_general`` Flax layers take.

- ``Fp8Config``: formats, scaling (``current``, ``delayed``, ``none``) and delayed scaling's options;
  ``config_for("fp8-delayed")`` reads a recipe's.
- ``Fp8DotGeneral(config)``: a stateless ``dot_general`` (current scaling, the unscaled baseline)
  for ``nnx.Linear(..., dot_general=...)`` or linen's ``nn.Dense(..., dot_general=...)``.
- ``fp8_dot_general(lhs, rhs, dims, config, meta=...)``: the function, with delayed scaling's
  ``Fp8Meta`` (amax history and scales) as an argument; ``update`` folds a step's gradient with
  respect to it into the state (skipped steps and accumulation windows from ``skip_nonfinite``'s state).
- Flax (imported on first use): ``NnxFp8DotGeneral`` and ``Fp8MetaVariable`` with ``update_nnx``;
  ``linen_dot_general_cls`` / ``LinenFp8DotGeneral`` with the ``"fp8_meta"`` collection.
- The casts: ``amax``, ``current_scale``, ``delayed_scale``, ``quantize``, ``dequantize``.

See docs/jax.md ("fp8").
"""

from __future__ import annotations

from typing import Any

from mixprec._lazy import lazy_exports
from mixprec.jax.fp8.casts import (
    E4M3,
    E5M2,
    Fp8Config,
    amax,
    current_scale,
    delayed_scale,
    dequantize,
    quantize,
)
from mixprec.jax.fp8.dot import Fp8DotGeneral, Fp8Meta, advance, fp8_dot_general, record, update


def config_for(recipe: Any) -> Fp8Config:
    """The ``Fp8Config`` of an fp8 recipe (a name such as ``"fp8-current"``, or a ``JaxRecipe``)."""
    from mixprec.jax.recipes import get_recipe

    r = get_recipe(recipe)
    if r.fp8 is None:
        raise ValueError(f"recipe {r.name!r} is not an fp8 recipe; the fp8 ones are fp8-current, fp8-delayed and "
                         "the unsafe fp8-unscaled baseline")
    return r.fp8


_LAZY = {name: "mixprec.jax.fp8.flax_layers" for name in (
    "NnxFp8DotGeneral", "Fp8MetaVariable", "update_nnx", "LinenFp8DotGeneral", "linen_dot_general_cls", "COLLECTION")}

__all__ = (
    "E4M3", "E5M2", "Fp8Config", "Fp8DotGeneral", "Fp8Meta", "advance", "amax", "config_for", "current_scale",
    "delayed_scale", "dequantize", "fp8_dot_general", "quantize", "record", "update", *sorted(_LAZY),
)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
