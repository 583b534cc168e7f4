"""``skip_nonfinite``: an optax wrapper that unscales, checks, adjusts the loss scale and commits
or skips the step, all inside the jitted update (the seed's ``select_tree`` pattern, packaged).

>>> import optax, jax.numpy as jnp
>>> tx = skip_nonfinite(optax.sgd(0.1), "fp16-mixed")
>>> params = {"w": jnp.ones(2)}
>>> state = tx.init(params)
>>> grads = {"w": jnp.array([1.0, jnp.inf])}          # an overflow in the scaled backward
>>> updates, state = tx.update(grads, state, params)
>>> optax.apply_updates(params, updates)["w"].tolist(), int(state.skipped), float(loss_scale_of(state).loss_scale)
([1.0, 1.0], 1, 32768.0)

The step, in order (``update(scaled_grads, state, params)``):

1. unscale with the state's loss scale (``LossScale.unscale``: multiplied by the fp32 reciprocal,
   so 16-bit gradients come out fp32, never unscaled in 16 bits);
2. ``all_finite`` of the unscaled gradients, all-reduced over ``axis_name`` when given;
3. the inner transformation's update, on the unscaled gradients: a clip inside ``inner``
   (``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``) sees true gradients, the
   right order by construction;
4. commit or skip with ``select_tree``: on a skipped step the inner state is returned unchanged and
   the updates are ``-0.0``, the one value whose addition leaves every float (``-0.0``
   included) bitwise unchanged, so ``optax.apply_updates`` keeps the parameters exactly;
5. ``loss_scale.adjust(finite)``; ``skipped`` counts skipped steps, ``last_skipped`` flags this one.

Both branches are computed and selected (no ``lax.cond``), so the step has one shape under ``jit``,
``vmap``, ``lax.scan`` and ``pmap``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mixprec.jax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale, all_finite, select_tree

_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


class SkipNonFiniteState(NamedTuple):
    """The wrapper's state (a pytree).

    Attributes:
        inner_state: the wrapped transformation's state.
        loss_scale: the scale to multiply the next step's loss by (``loss_scale_of(state)``).
        skipped: int32, steps skipped so far.
        last_skipped: bool, whether the last update was skipped.
    """

    inner_state: Any
    loss_scale: LossScale
    skipped: jax.Array
    last_skipped: jax.Array


def _as_loss_scale(spec: Any) -> LossScale:
    if spec is None:
        return NoOpLossScale()
    if isinstance(spec, _SCALES):
        return spec
    from mixprec.jax.recipes import JaxRecipe, get_recipe

    if isinstance(spec, (str, JaxRecipe)):
        return get_recipe(spec).loss_scale()
    raise TypeError(
        "skip_nonfinite takes a recipe (name or JaxRecipe), a loss scale (NoOpLossScale, StaticLossScale, "
        f"DynamicLossScale) or None; got {type(spec).__name__}"
    )


def _identity_update(u: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(u), jnp.floating):
        return jnp.full_like(u, -0.0)  # p + (-0.0) == p bitwise, for p = -0.0 too (0.0 would turn it into +0.0)
    return jnp.zeros_like(u)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    recipe: Any = None,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it receives unscaled gradients and steps only when they are finite.

    Args:
        inner: the optimizer (any optax transformation, chains included).
        recipe: where the loss scale comes from: a recipe name or ``JaxRecipe`` (``"fp16-mixed"``
            gives a ``DynamicLossScale`` at 2^16), a loss scale object (a ``DynamicLossScale`` with
            ``max_loss_scale`` or ``hysteresis``, say), or None (no scaling; non-finite steps are
            still skipped).
        axis_name: the mapped axis (``pmap``, ``shard_map``, ``vmap``) over which gradients are
            split or replicated: the finiteness decision is all-reduced over it, so every replica
            skips the same steps and keeps the same loss scale.

    The loss scale to multiply the loss by is ``loss_scale_of(state)``; see the module docstring
    for the order of the step.
    """
    inner = optax.with_extra_args_support(inner)
    initial_scale = _as_loss_scale(recipe)

    def init(params: Any) -> SkipNonFiniteState:
        return SkipNonFiniteState(
            inner_state=inner.init(params),
            loss_scale=initial_scale,
            skipped=jnp.zeros([], jnp.int32),
            last_skipped=jnp.zeros([], jnp.bool_),
        )

    def update(updates: Any, state: SkipNonFiniteState, params: Any = None, **extra_args: Any) -> tuple[Any, SkipNonFiniteState]:
        if not isinstance(state, SkipNonFiniteState):
            raise TypeError(
                f"skip_nonfinite's update got a {type(state).__name__} as its state; pass the state its init returned"
            )
        grads = state.loss_scale.unscale(updates)
        finite = all_finite(grads, axis_name)
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        try:
            inner_state = select_tree(finite, new_inner, state.inner_state)
        except TypeError as e:
            raise TypeError(
                f"skip_nonfinite: the inner optimizer changed its state's dtypes or shapes in update ({e}). This happens "
                "when its state was initialised from 16-bit parameters and it now receives fp32 (unscaled) gradients: "
                "keep fp32 parameters in the optimizer (the master copy) and cast them to the compute dtype in the "
                "forward with policy.cast_to_compute"
            ) from None
        out = select_tree(finite, new_updates, jax.tree_util.tree_map(_identity_update, new_updates))
        skipped = ~finite
        return out, SkipNonFiniteState(
            inner_state=inner_state,
            loss_scale=state.loss_scale.adjust(finite),
            skipped=state.skipped + skipped.astype(jnp.int32),
            last_skipped=skipped,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _find_state(state: Any) -> SkipNonFiniteState:
    found = [
        s for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState))
        if isinstance(s, SkipNonFiniteState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected the state of exactly one skip_nonfinite transformation in this optimizer state, found {len(found)}"
        )
    return found[0]


def loss_scale_of(state: Any) -> LossScale:
    """The loss scale to multiply the next loss by, from an optimizer state holding a ``skip_nonfinite`` state
    (directly, or inside ``optax.chain``/``inject_hyperparams`` states)."""
    return _find_state(state).loss_scale


def skipped_steps_of(state: Any) -> jax.Array:
    """The number of steps ``skip_nonfinite`` skipped (an int32 array)."""
    return _find_state(state).skipped
