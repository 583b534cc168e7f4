"""The fp8 dot as Flax layers take it: NNX (``nnx.Linear(..., dot_general=NnxFp8DotGeneral(cfg))``) and
linen (``nn.Dense(..., dot_general_cls=linen_dot_general_cls(cfg))``), current, delayed and unscaled.

Delayed scaling's state is the layer's: an ``Fp8MetaVariable`` (NNX) or the ``"fp8_meta"``
collection (linen), each holding an ``Fp8Meta``. Take the gradient with respect to it too, then
fold it in after the optimizer step:

- NNX: ``grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, Fp8MetaVariable)))(model, ...)``;
  ``optimizer.update(model, grads)`` (``wrt=nnx.Param`` steps the parameters only);
  ``update_nnx(model, grads, optimizer.opt_state)``;
- linen: ``jax.grad(loss, argnums=(0, 1))(params, fp8_meta, ...)`` with
  ``model.apply({"params": params, "fp8_meta": fp8_meta}, x)``; then
  ``fp8_meta = mixprec.jax.fp8.update(fp8_meta, fp8_grads, opt_state)``.

Importing this module imports flax (``pip install flax``; it is in the ``jax`` extra).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from mixprec.jax.fp8.casts import Fp8Config
from mixprec.jax.fp8.dot import Fp8Meta, _check_extra, fp8_dot_general, update

#: the linen collection delayed scaling's state lives in
COLLECTION = "fp8_meta"


def _config(config: Any) -> Fp8Config:
    if isinstance(config, Fp8Config):
        return config
    from mixprec.jax.fp8 import config_for

    return config_for(config)


class Fp8MetaVariable(nnx.Variable):
    """An NNX variable holding a layer's ``Fp8Meta`` (delayed scaling's amax history and scales)."""


class NnxFp8DotGeneral(nnx.Module):
    """An fp8 ``dot_general`` for ``nnx.Linear(..., dot_general=NnxFp8DotGeneral(config))``.

    ``config``: an ``Fp8Config`` or an fp8 recipe (``"fp8-delayed"``, a ``JaxRecipe``). One instance
    per layer: under delayed scaling it holds that layer's state (``self.meta``).
    """

    def __init__(self, config: Any) -> None:
        self.config = _config(config)
        if self.config.scaling == "delayed":
            self.meta = Fp8MetaVariable(Fp8Meta.init(self.config))

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        _check_extra(kwargs)
        meta = self.meta.get_value() if self.config.scaling == "delayed" else None
        return fp8_dot_general(lhs, rhs, dimension_numbers, self.config, meta, precision, preferred_element_type)


def update_nnx(model: Any, grads: Any, opt_state: Any = None, *, skipped: Any = None) -> None:
    """Delayed scaling's end of step for every ``NnxFp8DotGeneral`` in ``model`` (in place), from the
    gradient ``grads`` (which must include the ``Fp8MetaVariable`` entries) and the optimizer state."""
    state = nnx.state(model, Fp8MetaVariable)
    observed = nnx.state(grads, Fp8MetaVariable)
    if not jax.tree_util.tree_leaves(state):
        return
    if jax.tree_util.tree_structure(nnx.to_pure_dict(state)) != jax.tree_util.tree_structure(nnx.to_pure_dict(observed)):
        raise ValueError(
            "update_nnx: the gradient holds no Fp8MetaVariable entries for this model's fp8 layers; take it with "
            "nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, Fp8MetaVariable))) so that the fp8 dots "
            "can report their amaxes (without them the scales would never move)"
        )
    new = update(nnx.to_pure_dict(state), nnx.to_pure_dict(observed), opt_state, skipped=skipped)
    nnx.replace_by_pure_dict(state, new)
    nnx.update(model, state)


class LinenFp8DotGeneral(nn.Module):
    """An fp8 ``dot_general`` as a linen module; ``nn.Dense(..., dot_general_cls=linen_dot_general_cls(config))``."""

    config: Fp8Config

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        _check_extra(kwargs)
        cfg = _config(self.config)
        meta = self.variable(COLLECTION, "meta", Fp8Meta.init, cfg).value if cfg.scaling == "delayed" else None
        return fp8_dot_general(lhs, rhs, dimension_numbers, cfg, meta, precision, preferred_element_type)


def linen_dot_general_cls(config: Any) -> Any:
    """The class linen's ``Dense`` / ``DenseGeneral`` / ``Einsum`` instantiate as ``dot_general_cls()``."""
    return functools.partial(LinenFp8DotGeneral, config=_config(config))
