"""Where a ``skip_nonfinite`` transformation sits among optax's combinators, checked when its ``init``
runs: it must be the outermost one.

- ``optax.chain(t, skip_nonfinite(opt))``: ``t`` runs first, on the scaled gradient, and updates its
  own state before any finiteness check. A clip clips the scaled gradient (``clip_by_global_norm(1.0)``
  of a gradient scaled by 2^16 is a step 2^16 times too small: the model does not train), a weight
  decay adds ``wd * p`` to it, an Adam state is poisoned by the first inf. Write
  ``skip_nonfinite(optax.chain(t, opt), recipe)``.
- ``skip_nonfinite(skip_nonfinite(opt))`` (a helper that wraps, wrapped again), or one inside a chain
  inside another: the gradient is unscaled twice, every step is a loss scale (2^16) too small, and
  ``loss_scale_of`` hands out the outer scale only.
- ``optax.MultiSteps(skip_nonfinite(opt))``: MultiSteps resets its accumulator with ``(1 - emit) * acc``,
  which keeps a NaN: after one overflowing micro-batch every window is skipped, for good. Use
  ``skip_nonfinite(opt, recipe, every_k=k)``.
- ``optax.chain(skip_nonfinite(opt), t)``: ``t`` runs on every step, skipped ones included: it turns the
  ``-0.0`` updates of a skipped step into a real one (``add_decayed_weights`` moves the parameters) and
  advances its state (a schedule's count). Write ``skip_nonfinite(optax.chain(opt, t), recipe)``.
- ``optax.inject_hyperparams(lambda lr: skip_nonfinite(opt(lr)))``: the schedule's count advances on
  skipped steps. ``skip_nonfinite(optax.inject_hyperparams(opt)(learning_rate=schedule), recipe)`` holds it.
- ``optax.masked(skip_nonfinite(opt), mask)`` and a ``skip_nonfinite`` as one partition of
  ``optax.multi_transform``: the other leaves get the scaled gradient (``masked`` passes it through; another
  partition's optimizer steps with it) and are never checked. Wrap the ``multi_transform`` instead.
- ``optax.apply_if_finite(skip_nonfinite(opt), n)``: it checks the scaled gradient and, rejecting an
  overflow, keeps the wrapper's state, so the loss scale is not lowered (and after ``n`` overflows in a row
  it lets them through). ``skip_nonfinite`` already skips non-finite steps; drop ``apply_if_finite``.

``init`` finds its callers on the Python stack (optax's ``chain`` / ``named_chain`` ``init_fn``,
``MultiSteps.init``, and the ``init`` of ``masked``, ``inject_hyperparams``, ``apply_if_finite`` and
``conditionally_transform`` / ``conditionally_mask``, known by their code objects): the check costs nothing per
step and runs before any training. A combinator it
does not recognise is not checked; ``mixprec.jax.audit`` reports a clip before the unscaling from the
traced step whatever built it.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from mixprec.jax.skip_state import MULTISTEPS_MESSAGE

CHAIN_MESSAGE = (
    "skip_nonfinite must be the outermost transformation, but it is inside optax.chain after {n} other "
    "transformation(s), which would read the SCALED gradient and update their state before the finiteness check "
    "(a clip_by_global_norm would clip the scaled gradient: the model would barely train). Put them inside it: "
    "skip_nonfinite(optax.chain(<the others>, <optimizer>), recipe)"
)


AFTER_MESSAGE = (
    "skip_nonfinite must be the outermost transformation, but it is inside optax.chain before {n} other "
    "transformation(s), which run on every step, skipped ones included: they turn a skipped step's -0.0 updates into "
    "a real step (add_decayed_weights moves the parameters) and advance their state (a schedule's count). Put them "
    "inside it: skip_nonfinite(optax.chain(<optimizer>, <the others>), recipe)"
)

WRAPPED_MESSAGES = {
    "masked": (
        "skip_nonfinite is inside optax.masked (or is one partition of optax.multi_transform): the other parameters "
        "get the SCALED gradient (masked passes it through, another partition's optimizer steps with it) and their "
        "finiteness is never checked. Wrap the whole optimizer once: "
        "skip_nonfinite(optax.multi_transform({...}, labels), recipe)"
    ),
    "inject_hyperparams": (
        "skip_nonfinite is inside optax.inject_hyperparams, whose count (and schedules) advance on every update, "
        "skipped steps included: the learning-rate schedule would run ahead of the steps taken. Inject the "
        "hyperparameters inside it: skip_nonfinite(optax.inject_hyperparams(optax.adamw)(learning_rate=schedule), "
        "recipe)"
    ),
    "apply_if_finite": (
        "skip_nonfinite is inside optax.apply_if_finite, which checks the SCALED gradient and, rejecting an overflow, "
        "keeps skip_nonfinite's state as it was: the loss scale is never lowered, and after max_consecutive_errors "
        "overflows in a row it lets them through. skip_nonfinite already skips non-finite steps (and lowers the "
        "scale): drop apply_if_finite"
    ),
    "conditionally_transform": (
        "skip_nonfinite is inside optax.conditionally_transform / conditionally_mask: the steps it does not run keep "
        "the loss scale and pass the SCALED gradient on. Wrap the conditional transformation instead: "
        "skip_nonfinite(optax.conditionally_transform(<optimizer>, should_transform_fn), recipe)"
    ),
}


NESTED_MESSAGE = (
    "skip_nonfinite is nested inside another skip_nonfinite: the gradient would be unscaled twice (every step a "
    "loss scale too small) while loss_scale_of gives only the outer scale. Wrap the optimizer once: "
    "skip_nonfinite(<optimizer>, recipe)"
)


def _chain_position(frame: Any, target: Any) -> tuple[int, int, Any] | None:
    """In an optax chain's ``init_fn`` frame, the index of ``target`` (an init function, or the code of an
    inner chain's init_fn frame) among its transformations, their number, and the frame's own function identity."""
    local = frame.f_locals
    inits = local.get("init_fns")
    if inits is None and "transforms" in local:
        inits = [getattr(t, "init", None) if not isinstance(t, tuple) else getattr(t[1], "init", None)
                 for t in local["transforms"]]
    if inits is None:
        return None
    for i, fn in enumerate(inits):
        if fn is target or (isinstance(target, tuple) and _is_frame_function(fn, *target)):
            return i, len(inits), (frame.f_code, local.get("init_fns", local.get("transforms")))
    return None


def _is_frame_function(fn: Any, code: Any, closed: Any) -> bool:
    if getattr(fn, "__code__", None) is not code:
        return False
    cells = getattr(fn, "__closure__", None) or ()
    try:
        return any(c.cell_contents is closed for c in cells)
    except ValueError:
        return False


def check_nesting(init_fn: Any) -> None:
    """Raise when the ``skip_nonfinite`` whose ``init`` is ``init_fn`` (running now) is nested inside
    ``optax.MultiSteps``, inside another ``skip_nonfinite``, inside an ``optax.chain`` beside other
    transformations, or inside one of optax's wrappers that must not hold it (see the module docstring).
    The whole stack is read: a ``skip_nonfinite`` nested in another is named as such wherever it sits."""
    import optax

    multi = getattr(optax, "MultiSteps", None)
    frame = sys._getframe(2)  # the caller of our init
    target: Any = init_fn
    depth = 0
    first: str | None = None  # the innermost misplacement; a nested skip_nonfinite or MultiSteps wins over it
    while frame is not None and depth < 64:
        code = frame.f_code
        if code is init_fn.__code__:  # another skip_nonfinite's init is running ours
            raise ValueError(NESTED_MESSAGE)
        if multi is not None and code.co_name == "init" and isinstance(frame.f_locals.get("self"), multi):
            raise ValueError(MULTISTEPS_MESSAGE)
        wrapper = _wrappers().get(code)
        if wrapper is not None and first is None:
            first = WRAPPED_MESSAGES[wrapper]
        if code.co_name == "init_fn" and "optax" in code.co_filename:
            found = _chain_position(frame, target)
            if found is not None:
                index, count, target = found
                if first is None and index > 0:
                    first = CHAIN_MESSAGE.format(n=index)
                elif first is None and index < count - 1:
                    first = AFTER_MESSAGE.format(n=count - 1 - index)
        frame, depth = frame.f_back, depth + 1
    if first is not None:
        raise ValueError(first)


_WRAPPERS: dict[Any, str] | None = None


def _wrappers() -> dict[Any, str]:
    """The code objects of the ``init`` functions of optax's wrappers that must not hold a ``skip_nonfinite``
    (one code object per wrapper, shared by all its instances), by the key of their message. Built once, from
    tiny instances; a wrapper this optax version lacks is left out."""
    global _WRAPPERS
    if _WRAPPERS is None:
        import optax

        makers = {
            "masked": lambda: optax.masked(optax.identity(), {}),
            "inject_hyperparams": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            "apply_if_finite": lambda: optax.apply_if_finite(optax.identity(), 1),
            "conditionally_transform": lambda: optax.conditionally_transform(optax.identity(), lambda step: True),
            "conditionally_mask": lambda: optax.conditionally_mask(optax.identity(), lambda step: True),
        }
        found: dict[Any, str] = {}
        for key, make in makers.items():
            try:
                with warnings.catch_warnings():  # a wrapper optax deprecates still holds a skip_nonfinite wrongly
                    warnings.simplefilter("ignore")
                    code = make().init.__code__
            except Exception:  # noqa: BLE001  (absent from this optax, or built otherwise)
                continue
            found[code] = "conditionally_transform" if key == "conditionally_mask" else key
        _WRAPPERS = found
    return _WRAPPERS
