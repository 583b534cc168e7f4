"""An fp8 ``dot_general``: the torch side's ``Fp8Linear`` numerics as a drop-in for ``jax.lax.dot_general``.

Forward casts both operands to fp8 with their scales (e4m3 under the hybrid format) and multiplies
the dequantized operands with f32 accumulation; backward casts the output gradient (e5m2 under the
hybrid format) and computes both operand gradients from fp8 operands with f32 accumulation, as
``mixprec.fp8.gemm``'s ``emulate`` backend does. The fp8 operands (1 byte each) and their scales are
what backward keeps. The output comes back in ``preferred_element_type`` or the operands' dtype;
each operand gradient in that operand's dtype.

Any ``dimension_numbers`` work (batch dimensions included): the gradients are the transposes of
the same ``dot_general``, taken by ``jax.vjp`` on the dequantized fp8 operands.

Delayed scaling needs state: an ``Fp8Meta`` (Transformer Engine's amax history, ``L x 3``, and
scales, ``3``: input, weight, grad_output), passed as an argument. The dot casts with ``meta.scale``
and reports what it saw through the gradient: the cotangent of ``meta`` is an ``Fp8Meta`` whose
history holds this step's three amaxes in row 0 (the input's and the weight's from forward, the
output gradient's from backward) and zeros elsewhere. ``update`` folds it in and, at the end of an
optimizer step, rolls the history and recomputes the scales exactly as ``mixprec.fp8.delayed``
does (TE's ``amax_and_scale_update``); a skipped step only empties the current slot. An eval
forward (no gradient taken) leaves the state alone, as on the torch side.

A dot applied twice in one step (weights tied) receives the sum of its two cotangents, so its
recorded amax is the sum of the two amaxes: an overestimate (a smaller scale, never a saturation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import tree_util

from mixprec.jax.fp8.casts import Fp8Config, amax, delayed_scale, dequantize, quantize


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """Delayed scaling's state for one fp8 dot (a pytree; ``config`` is aux data).

    Attributes:
        amax_history: f32 ``(L, 3)``; row 0 is the current step's slot, the rest the previous steps.
        scale: f32 ``(3,)``: the scales this step casts with (TE's initial scale is 1).
        config: the ``Fp8Config`` (formats, amax algorithm, margin) its update follows.
    """

    amax_history: Any
    scale: Any
    config: Fp8Config

    @classmethod
    def init(cls, config: Fp8Config) -> Fp8Meta:
        if config.scaling != "delayed":
            raise ValueError(f"Fp8Meta is delayed scaling's state; this config uses {config.scaling!r} scaling (no state)")
        return cls(jnp.zeros((config.amax_history_len, 3), jnp.float32), jnp.ones((3,), jnp.float32), config)


tree_util.register_pytree_with_keys(
    Fp8Meta,
    lambda m: (((tree_util.GetAttrKey("amax_history"), m.amax_history), (tree_util.GetAttrKey("scale"), m.scale)), m.config),
    lambda config, leaves: Fp8Meta(leaves[0], leaves[1], config),
    lambda m: ((m.amax_history, m.scale), m.config),
)


def is_meta(x: Any) -> bool:
    return isinstance(x, Fp8Meta)


# ---------------------------------------------------------------------------- the dot


def _gemm(a: jax.Array, b: jax.Array, dims: Any, precision: Any) -> jax.Array:
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _fp8_dot(cfg: Fp8Config, dims: Any, precision: Any, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any,
             lhs: jax.Array, rhs: jax.Array, meta: Fp8Meta | None) -> jax.Array:
    return _fp8_dot_fwd(cfg, dims, precision, out_dtype, lhs_dtype, rhs_dtype, lhs, rhs, meta)[0]


def _fp8_dot_fwd(cfg: Fp8Config, dims: Any, precision: Any, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any,
                 lhs: jax.Array, rhs: jax.Array, meta: Fp8Meta | None) -> tuple[jax.Array, tuple[Any, ...]]:
    scales = None if meta is None else meta.scale
    fx, fw, _ = cfg.formats
    sx, sw = cfg.scale(lhs, 0, scales), cfg.scale(rhs, 1, scales)
    x_q, w_q = quantize(lhs, sx, fx), quantize(rhs, sw, fw)
    out = _gemm(dequantize(x_q, sx), dequantize(w_q, sw), dims, precision).astype(out_dtype)
    seen = None if meta is None else (amax(lhs), amax(rhs))
    return out, (x_q, sx, w_q, sw, meta, seen)


def _fp8_dot_bwd(cfg: Fp8Config, dims: Any, precision: Any, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any,
                 res: tuple[Any, ...], g: jax.Array) -> tuple[Any, Any, Any]:
    x_q, sx, w_q, sw, meta, seen = res
    fg = cfg.formats[2]
    sg = cfg.scale(g, 2, None if meta is None else meta.scale)
    g_q = quantize(g, sg, fg)
    _, transpose = jax.vjp(lambda a, b: _gemm(a, b, dims, precision), dequantize(x_q, sx), dequantize(w_q, sw))
    grad_lhs, grad_rhs = transpose(dequantize(g_q, sg))
    meta_ct = None
    if meta is not None:
        row = jnp.stack([seen[0], seen[1], amax(g)])
        meta_ct = Fp8Meta(jnp.zeros_like(meta.amax_history).at[0].set(row), jnp.zeros_like(meta.scale), meta.config)
    return grad_lhs.astype(lhs_dtype), grad_rhs.astype(rhs_dtype), meta_ct


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _hashable_precision(precision: Any) -> Any:
    if isinstance(precision, list):
        return tuple(precision)
    return precision


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, config: Fp8Config,
                    meta: Fp8Meta | None = None, precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` computed from fp8 operands (module docstring).

    ``meta``: the layer's ``Fp8Meta`` under delayed scaling (required there, refused otherwise).
    """
    if not isinstance(config, Fp8Config):
        raise TypeError(f"fp8_dot_general's config must be a mixprec.jax.fp8.Fp8Config, got {type(config).__name__}")
    if config.scaling == "delayed":
        if not isinstance(meta, Fp8Meta):
            raise TypeError(
                "fp8 delayed scaling casts with the scales of an amax history: pass the layer's state, "
                f"meta=Fp8Meta.init(config) (threaded through the step and updated with fp8.update); got {meta!r}"
            )
        if meta.config != config:
            raise ValueError(f"this Fp8Meta was made for {meta.config.describe()}, the dot is {config.describe()}")
    elif meta is not None:
        raise ValueError(f"{config.scaling} fp8 scaling keeps no state; meta= applies to delayed scaling only")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"fp8_dot_general: {name} is {jnp.result_type(x)}; the fp8 casts take floating-point operands")
    dims = tree_util.tree_map(int, dimension_numbers)
    dims = tuple(tuple(tuple(d) for d in pair) for pair in dims)
    out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)
    return _fp8_dot(config, dims, _hashable_precision(precision), out_dtype, jnp.result_type(lhs), jnp.result_type(rhs),
                    lhs, rhs, meta)


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """A stateless fp8 ``dot_general`` with ``lax.dot_general``'s signature, for current scaling and
    the unscaled baseline: ``nnx.Linear(..., dot_general=Fp8DotGeneral(config))``, linen's
    ``nn.Dense(..., dot_general=Fp8DotGeneral(config))``, or called directly. Delayed scaling needs
    state: ``mixprec.jax.fp8.flax``'s modules, or ``fp8_dot_general(..., meta=...)``."""

    config: Fp8Config

    def __post_init__(self) -> None:
        if self.config.scaling == "delayed":
            raise ValueError(
                "Fp8DotGeneral is stateless; delayed scaling keeps an amax history: use mixprec.jax.fp8.NnxFp8DotGeneral "
                "/ LinenFp8DotGeneral (Flax), or fp8_dot_general(..., meta=Fp8Meta.init(config)) in a pure function"
            )

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        _check_extra(kwargs)
        return fp8_dot_general(lhs, rhs, dimension_numbers, self.config, None, precision, preferred_element_type)


def _check_extra(kwargs: dict[str, Any]) -> None:
    """Flax passes ``out_sharding=None``; anything else would be dropped, so it is refused."""
    extra = {k: v for k, v in kwargs.items() if v is not None}
    if extra:
        raise TypeError(f"the fp8 dot_general does not implement {sorted(extra)} (lax.dot_general options); "
                        "leave them unset on the layer")


# ---------------------------------------------------------------------------- delayed scaling's update


def _rolled(h: jax.Array) -> jax.Array:
    """TE's roll along the steps: ``[0, h[2], ..., h[L-1], h[0]]`` (``[0]`` when L is 1)."""
    zero = jnp.zeros_like(h[:1])
    if h.shape[0] == 1:
        return zero
    return jnp.concatenate([zero, h[2:], h[:1]], axis=0)


def _window_amax(h: jax.Array, algo: str) -> jax.Array:
    if algo == "most_recent":
        return h[0]
    # fmaxf semantics: a NaN loses to any number (an inf stays: non-finite keeps the old scale)
    return jnp.nan_to_num(h, nan=0.0, posinf=jnp.inf, neginf=0.0).max(axis=0)


def record(meta: Fp8Meta, observed: Fp8Meta) -> Fp8Meta:
    """Raise the current step's slot to what a step's dots saw (``observed``: the cotangent of ``meta``)."""
    h = meta.amax_history.at[0].max(observed.amax_history[0])
    return Fp8Meta(h, meta.scale, meta.config)


def advance(meta: Fp8Meta, skipped: Any = False) -> Fp8Meta:
    """End of an optimizer step (``mixprec.fp8.delayed.update`` for one layer): roll the history and
    recompute the scales, per role, where the slot saw something; when ``skipped``, only empty the slot."""
    cfg = meta.config
    h, s = meta.amax_history, meta.scale
    seen = h[0] != 0
    new_h = jnp.where(seen[None, :], _rolled(h), h)
    a = _window_amax(h, cfg.amax_compute_algo)
    new_s = jnp.stack([delayed_scale(a[r], s[r], f, cfg.margin) for r, f in enumerate(cfg.formats)])
    new_s = jnp.where(seen, new_s, s)
    skipped = jnp.asarray(skipped, jnp.bool_)
    new_h = jnp.where(skipped, h.at[0].set(0.0), new_h)
    new_s = jnp.where(skipped, s, new_s)
    return Fp8Meta(new_h, new_s, cfg)


def update(state: Any, observed: Any, opt_state: Any = None, *, skipped: Any = None) -> Any:
    """Delayed scaling's end of step for every ``Fp8Meta`` in ``state`` (any pytree of them).

    ``observed``: the gradient of the loss with respect to ``state`` (same structure). The step's
    outcome comes from ``opt_state`` (the state of a ``skip_nonfinite`` optimizer: skipped or not,
    and, with ``every_k`` accumulation, whether this call ended a window; until then the slot only
    accumulates the micro-batches' amaxes) or from ``skipped`` (a bool) when there is no such optimizer.
    """
    if opt_state is not None and skipped is not None:
        raise ValueError("fp8.update takes the step's outcome from opt_state or skipped=, not both")
    ended: Any = True
    if opt_state is not None:
        from mixprec.jax.skip_state import step_outcome

        skipped, ended = step_outcome(opt_state)
    skipped = False if skipped is None else skipped

    def one(meta: Any, obs: Any) -> Any:
        if not is_meta(meta):
            return meta
        if not is_meta(obs) or obs.amax_history.shape != meta.amax_history.shape:
            raise ValueError("fp8.update: observed must be the gradient with respect to the fp8 state (the same "
                             f"structure of Fp8Meta), got {type(obs).__name__} where the state has an Fp8Meta")
        recorded = record(meta, obs)
        advanced = advance(recorded, skipped)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(ended, a, b), advanced, recorded)

    return jax.tree_util.tree_map(one, state, observed, is_leaf=is_meta)
