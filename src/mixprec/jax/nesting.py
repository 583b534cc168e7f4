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

``init`` finds its callers on the Python stack (optax's ``chain`` / ``named_chain`` ``init_fn``, and
``MultiSteps.init``): the check costs nothing per step and runs before any training. A combinator it
does not recognise is not checked; ``mixprec.jax.audit`` reports a clip before the unscaling from the
traced step whatever built it.
"""

from __future__ import annotations

import sys
from typing import Any

from mixprec.jax.skip_state import MULTISTEPS_MESSAGE

CHAIN_MESSAGE = (
    "skip_nonfinite must be the outermost transformation, but it is inside optax.chain after {n} other "
    "transformation(s), which would read the SCALED gradient and update their state before the finiteness check "
    "(a clip_by_global_norm would clip the scaled gradient: the model would barely train). Put them inside it: "
    "skip_nonfinite(optax.chain(<the others>, <optimizer>), recipe)"
)


NESTED_MESSAGE = (
    "skip_nonfinite is nested inside another skip_nonfinite: the gradient would be unscaled twice (every step a "
    "loss scale too small) while loss_scale_of gives only the outer scale. Wrap the optimizer once: "
    "skip_nonfinite(<optimizer>, recipe)"
)


def _chain_position(frame: Any, target: Any) -> tuple[int, Any] | None:
    """In an optax chain's ``init_fn`` frame, the index of ``target`` (an init function, or the code of an
    inner chain's init_fn frame) among its transformations, and the frame's own function identity."""
    local = frame.f_locals
    inits = local.get("init_fns")
    if inits is None and "transforms" in local:
        inits = [getattr(t, "init", None) if not isinstance(t, tuple) else getattr(t[1], "init", None)
                 for t in local["transforms"]]
    if inits is None:
        return None
    for i, fn in enumerate(inits):
        if fn is target or (isinstance(target, tuple) and _is_frame_function(fn, *target)):
            return i, (frame.f_code, local.get("init_fns", local.get("transforms")))
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
    ``optax.MultiSteps``, inside another ``skip_nonfinite``, or after another transformation of an
    ``optax.chain`` (see the module docstring)."""
    import optax

    multi = getattr(optax, "MultiSteps", None)
    frame = sys._getframe(2)  # the caller of our init
    target: Any = init_fn
    depth = 0
    while frame is not None and depth < 64:
        code = frame.f_code
        if code is init_fn.__code__:  # another skip_nonfinite's init is running ours
            raise ValueError(NESTED_MESSAGE)
        if multi is not None and code.co_name == "init" and isinstance(frame.f_locals.get("self"), multi):
            raise ValueError(MULTISTEPS_MESSAGE)
        if code.co_name == "init_fn" and "optax" in code.co_filename:
            found = _chain_position(frame, target)
            if found is not None:
                index, target = found
                if index > 0:
                    raise ValueError(CHAIN_MESSAGE.format(n=index))
        frame, depth = frame.f_back, depth + 1
