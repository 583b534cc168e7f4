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
5. ``loss_scale.adjust(finite)``; ``state.skipped`` counts skipped steps, ``state.last_skipped`` flags this one.

Both branches are computed and selected (no ``lax.cond``), so the step has one shape under ``jit``,
``vmap``, ``lax.scan`` and ``pmap``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import jax.numpy as jnp
import optax

from mixprec.jax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale, all_finite, select_tree
from mixprec.jax.nesting import check_nesting
from mixprec.jax.skip_state import (  # noqa: F401  (re-exported: mixprec.jax's names live here)
    Accumulation,
    SkipNonFiniteState,
    loss_scale_of,
    skipped_steps_of,
    step_outcome,
)

_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def _as_loss_scale(spec: Any) -> LossScale:
    if spec is None:
        return NoOpLossScale()
    if isinstance(spec, _SCALES):
        _check_scale_value(spec)
        return spec
    from mixprec.jax.recipes import JaxRecipe, get_recipe

    if isinstance(spec, (str, JaxRecipe)):
        return get_recipe(spec).loss_scale()
    raise TypeError(
        "skip_nonfinite takes a recipe (name or JaxRecipe), a loss scale (NoOpLossScale, StaticLossScale, "
        f"DynamicLossScale) or None; got {type(spec).__name__}"
    )


def _check_scale_value(scale: LossScale) -> None:
    """A loss scale that is not finite and positive skips every step forever (torch's GradScaler refuses it)."""
    if isinstance(scale, NoOpLossScale):
        return
    value = scale.loss_scale
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(scale, DynamicLossScale) and not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise TypeError(
            f"skip_nonfinite: the DynamicLossScale's loss_scale is {jnp.result_type(value)}; it must be a float (an integer "
            "scale halves by truncation and its growth stops at the integer maximum). Start from e.g. "
            "DynamicLossScale(jnp.float32(2**16))"
        )
    v = np.asarray(value, dtype=np.float64)
    if not (np.isfinite(v).all() and (v > 0).all()):
        raise ValueError(
            f"skip_nonfinite: the loss scale is {v.tolist()}; it must be finite and positive (an infinite scale makes "
            "every scaled gradient inf, so every step would be skipped and the scale would stay inf). Start from "
            "e.g. DynamicLossScale(jnp.float32(2**16))"
        )


def _check_inner(inner: Any) -> None:
    if isinstance(inner, str):
        raise TypeError(
            f"skip_nonfinite wraps an optax optimizer, got the string {inner!r}: pass the transformation itself, "
            f"e.g. skip_nonfinite(optax.{inner.strip().lower() or 'adamw'}(learning_rate=3e-4), 'fp16-mixed')"
        )
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"skip_nonfinite wraps an optax GradientTransformation (with init and update), got {type(inner).__name__}; "
            "e.g. skip_nonfinite(optax.adamw(3e-4), 'fp16-mixed')"
        )


def _check_matches_params(grads: Any, params: Any) -> None:
    """The gradients must have the parameters' leaves and shapes: a stateless inner optimizer (sgd) returned updates
    of a gradient's shape for a missing or misshapen one without a word (``apply_updates`` then broadcast a ``(1,)``
    update over a parameter), a stateful one failed in a tree_map deep inside optax. Checked when tracing (once per
    compilation under ``jit``); the node types may differ (a ``FrozenDict`` of gradients for a dict of parameters)."""
    if params is None:
        return
    flat_g, flat_p = jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_flatten_with_path(params)[0]
    g = {jax.tree_util.keystr(k) or "(root)": v for k, v in flat_g}
    p = {jax.tree_util.keystr(k) or "(root)": v for k, v in flat_p}
    if g.keys() != p.keys():
        missing, extra = [k for k in p if k not in g], [k for k in g if k not in p]
        what = "; ".join(part for part in (missing and f"no gradient for {', '.join(missing[:5])}",
                                           extra and f"gradients for {', '.join(extra[:5])}, which are not parameters") if part)
        raise ValueError(
            f"skip_nonfinite: the gradients do not match the parameters ({what}): pass update(grads, state, params) the "
            "gradient of the loss with respect to exactly these parameters, e.g. jax.grad(loss_fn)(params)"
        )
    for name, leaf in g.items():
        if jnp.shape(leaf) != jnp.shape(p[name]):
            raise ValueError(
                f"skip_nonfinite: the gradient {name} has shape {list(jnp.shape(leaf))}, its parameter "
                f"{list(jnp.shape(p[name]))}: pass the gradient with respect to these parameters"
            )


def _commit_or_identity(commit: jax.Array, u: Any) -> Any:
    """``u`` where ``commit``, else the update that leaves a parameter bitwise unchanged: ``-0.0`` for floats
    (``p + (-0.0) == p`` for every ``p``, ``-0.0`` included; ``0.0`` would turn ``-0.0`` into ``+0.0``), 0 for
    integers. A scalar in ``where``: no per-leaf constant array to materialise."""
    dtype = jnp.result_type(u)
    zero = jnp.asarray(-0.0 if jnp.issubdtype(dtype, jnp.floating) else 0, dtype)
    return jnp.where(commit, u, zero)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    recipe: Any = None,
    *,
    axis_name: Any = None,
    every_k: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it receives unscaled gradients and steps only when they are finite.

    Args:
        inner: the optimizer (any optax transformation, chains included: put a clip inside, where it
            sees unscaled gradients).
        recipe: where the loss scale comes from: a recipe name or ``JaxRecipe`` (``"fp16-mixed"``
            gives a ``DynamicLossScale`` at 2^16), a loss scale object (a ``DynamicLossScale`` with
            ``max_loss_scale`` or ``hysteresis``, say), or None (no scaling; non-finite steps are
            still skipped).
        axis_name: the mapped axis (``pmap``, ``shard_map``, ``vmap``) over which gradients are
            split or replicated: the finiteness decision is all-reduced over it, so every replica
            skips the same steps and keeps the same loss scale.
        every_k: gradient accumulation, the torch side's ``accumulate=``: each ``update`` is one
            micro-batch; every ``every_k``-th closes the window and steps ``inner`` once with the mean
            of the window's unscaled gradients. The loss scale stays fixed within a window and is
            adjusted once per window; a window holding a non-finite micro-batch is discarded whole (no
            step, the scale lowered) and the next one starts clean. Between window ends the updates
            are ``-0.0`` (parameters bitwise unchanged).

    ``skip_nonfinite`` must be the outermost transformation: inside ``optax.chain`` after another one,
    that one would read the scaled gradient (a clip would clip it) and update its state before the
    finiteness check; inside ``optax.MultiSteps`` a NaN stays in MultiSteps' accumulator for good.
    Both are refused when ``init`` runs (use ``every_k`` for accumulation).

    The loss scale to multiply the loss by is ``loss_scale_of(state)``; see the module docstring
    for the order of the step.
    """
    _check_inner(inner)
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"skip_nonfinite: every_k must be an integer >= 1 (1: no accumulation), got {every_k!r}")
    inner = optax.with_extra_args_support(inner)
    initial_scale = _as_loss_scale(recipe)

    def init(params: Any) -> SkipNonFiniteState:
        check_nesting(init)
        accumulation = None
        if every_k > 1:
            zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), _acc_dtype(p)), params)
            accumulation = Accumulation(zeros, jnp.zeros([], jnp.int32), jnp.ones([], jnp.bool_))
        return SkipNonFiniteState(
            inner_state=inner.init(params),
            loss_scale=_fresh(initial_scale),
            skips=jnp.zeros([2], jnp.int32),
            accumulation=accumulation,
        )

    def update(updates: Any, state: SkipNonFiniteState, params: Any = None, **extra_args: Any) -> tuple[Any, SkipNonFiniteState]:
        if not isinstance(state, SkipNonFiniteState):
            raise TypeError(
                f"skip_nonfinite's update got a {type(state).__name__} as its state; pass the state its init returned"
            )
        if (state.accumulation is None) != (every_k == 1):
            raise ValueError(f"skip_nonfinite(every_k={every_k}) got a state made by a wrapper with another every_k")
        _check_matches_params(updates, params)
        grads = state.loss_scale.unscale(updates)
        finite = all_finite(grads, axis_name)
        acc = state.accumulation
        ended: Any = True
        if acc is not None:
            summed = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc.grads, grads)
            count = acc.count + 1
            ended = count == every_k
            finite = acc.finite & finite
            grads = jax.tree_util.tree_map(lambda a, g: (a / every_k).astype(jnp.result_type(g)), summed, grads)
            restart = jax.tree_util.tree_map(jnp.zeros_like, summed)
            acc = Accumulation(
                grads=jax.tree_util.tree_map(lambda z, a: jnp.where(ended, z, a), restart, summed),  # a select: no NaN kept
                count=jnp.where(ended, 0, count).astype(jnp.int32),
                finite=ended | finite,
            )
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        commit = finite if acc is None else finite & ended
        try:
            inner_state = select_tree(commit, new_inner, state.inner_state)
        except TypeError as e:
            raise TypeError(
                f"skip_nonfinite: the inner optimizer changed its state's dtypes or shapes in update ({e}). This happens "
                "when its state was initialised from 16-bit parameters and it now receives fp32 (unscaled) gradients: "
                "keep fp32 parameters in the optimizer (the master copy) and cast them to the compute dtype in the "
                "forward with policy.cast_to_compute"
            ) from None
        out = jax.tree_util.tree_map(lambda u: _commit_or_identity(commit, u), new_updates)
        skipped = ~finite if acc is None else ~finite & ended
        loss_scale = state.loss_scale.adjust(finite)
        if acc is not None:  # adjusted once per window, at its end
            loss_scale = jax.tree_util.tree_map(lambda n, o: jnp.where(ended, n, o), loss_scale, state.loss_scale)
        return out, SkipNonFiniteState(
            inner_state=inner_state,
            loss_scale=loss_scale,
            skips=state.skips * jnp.array([1, 0], jnp.int32) + skipped.astype(jnp.int32),  # [count + s, s]
            accumulation=acc,
        )

    init._mixprec_skip_nonfinite = True  # type: ignore[attr-defined]  # is_skip_nonfinite
    return optax.GradientTransformationExtraArgs(init, update)


def _fresh(scale: LossScale) -> LossScale:
    """The loss scale with its jax arrays copied: a state is the owner of its buffers. Handed out as given, every
    ``init`` shared the scale's arrays, so a jitted step with ``donate_argnums`` deleted them on its first call and each
    later ``init`` (the ``like`` of a resume, a restart) returned a state of deleted arrays."""
    return jax.tree_util.tree_map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, scale)


def is_skip_nonfinite(tx: Any) -> bool:
    """Whether ``tx`` is a transformation ``skip_nonfinite`` returned."""
    return bool(getattr(getattr(tx, "init", None), "_mixprec_skip_nonfinite", False))


def _acc_dtype(p: Any) -> Any:
    dtype = jnp.result_type(p)
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype
