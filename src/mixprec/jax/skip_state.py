"""The state of ``skip_nonfinite`` and what reads it (``loss_scale_of``, ``skipped_steps_of``,
``step_outcome``). Its own module, importing nothing else of mixprec.jax but the loss scales, so that
the fp8 update can read a step's outcome without importing the optimizer wrapper."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mixprec.jax.loss_scale import LossScale


class Accumulation(NamedTuple):
    """An accumulation window of ``skip_nonfinite(..., every_k=k)`` (a pytree).

    Attributes:
        grads: f32, the sum of the window's unscaled micro-batch gradients so far (zeros at its start).
        count: int32, micro-batches in the window so far (0 right after a window ended).
        finite: bool, whether every micro-batch of the window so far was finite.
    """

    grads: Any
    count: jax.Array
    finite: jax.Array


class SkipNonFiniteState(NamedTuple):
    """The wrapper's state (a pytree).

    Attributes:
        inner_state: the wrapped transformation's state.
        loss_scale: the scale to multiply the next step's loss by (``loss_scale_of(state)``).
        skips: int32 ``[2]``: optimizer steps skipped so far, and 1 when the last update skipped one.
            Read them as ``skipped`` and ``last_skipped``; one array, not two, because every leaf of a
            state costs a jitted step its own buffer at every call (~3 us on a CPU, measured).
        accumulation: the open window with ``every_k > 1`` (``Accumulation``), else None.

    Properties:
        skipped: int32, optimizer steps skipped so far.
        last_skipped: bool, whether the last update skipped an optimizer step (with ``every_k``: it ended
            a window that held a non-finite micro-batch).
    """

    inner_state: Any
    loss_scale: LossScale
    skips: jax.Array
    accumulation: Any = None

    @property
    def skipped(self) -> jax.Array:
        return self.skips[..., 0]

    @property
    def last_skipped(self) -> jax.Array:
        return self.skips[..., 1].astype(jnp.bool_)


def _path_names(path: Any) -> list[str]:
    return [type(k).__name__ + ":" + str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path]


def _find_state(state: Any) -> SkipNonFiniteState:
    is_ours = lambda x: isinstance(x, SkipNonFiniteState)  # noqa: E731
    found = [(p, s) for p, s in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_ours)[0] if is_ours(s)]
    if not found:
        raise ValueError(
            "this optimizer state holds no skip_nonfinite state: pass the state that the init of an optimizer built "
            "with mixprec.jax.skip_nonfinite(<optimizer>, recipe) returned"
        )
    if len(found) > 1:
        where = ", ".join(jax.tree_util.keystr(p) or "(root)" for p, _ in found)
        raise ValueError(
            f"this optimizer state holds {len(found)} skip_nonfinite states (at {where}), each with its own loss scale "
            "and its own skips: wrap the whole optimizer once instead, an optax.multi_transform included: "
            "skip_nonfinite(optax.multi_transform({...}, labels), recipe)"
        )
    _refuse_multisteps(state)
    return found[0][1]


def _refuse_multisteps(state: Any) -> None:
    import optax

    multi = getattr(optax, "MultiStepsState", None)
    if multi is None:
        return
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, multi))
    if any(isinstance(x, multi) and _contains_ours(x.inner_opt_state) for x in leaves):
        raise ValueError(MULTISTEPS_MESSAGE)


def _contains_ours(tree: Any) -> bool:
    is_ours = lambda x: isinstance(x, SkipNonFiniteState)  # noqa: E731
    return any(is_ours(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_ours))


MULTISTEPS_MESSAGE = (
    "optax.MultiSteps(skip_nonfinite(...)) stalls for good after one overflowing micro-batch: MultiSteps resets its "
    "accumulator with (1 - emit) * acc, which keeps a NaN, so every later window is skipped and the loss scale halves "
    "forever. Accumulate inside the wrapper instead: skip_nonfinite(optimizer, recipe, every_k=K) discards a "
    "non-finite window and starts a clean one"
)


def loss_scale_of(state: Any) -> LossScale:
    """The loss scale to multiply the next loss by, from an optimizer state holding a ``skip_nonfinite`` state
    (directly, or nested in another state, e.g. an ``optax.chain``'s)."""
    return _find_state(state).loss_scale


def skipped_steps_of(state: Any) -> jax.Array:
    """The number of optimizer steps ``skip_nonfinite`` skipped (an int32 array)."""
    return _find_state(state).skipped


def step_outcome(state: Any) -> tuple[jax.Array, jax.Array]:
    """``(skipped, ended)`` of the last ``update``: whether it skipped an optimizer step, and whether it
    ended one (always True without ``every_k``; with it, True when the call closed a window)."""
    s = _find_state(state)
    if s.accumulation is None:
        return s.last_skipped, jnp.asarray(True)
    return s.last_skipped, s.accumulation.count == 0
