"""Loss scales for JAX: jmp's ``NoOpLossScale``, ``StaticLossScale``, ``DynamicLossScale``,
``all_finite`` and ``select_tree``, with jmp's bugs fixed and torch GradScaler's extras.

The names, defaults and pytree leaves are jmp's (``jmp._src.loss_scale``): ``DynamicLossScale``
flattens to exactly ``(loss_scale, counter)``, grows by ``factor`` after ``period`` finite steps
and shrinks by it on a non-finite one, never below ``min_loss_scale`` (default 1).

Fixed:

- ``min_loss_scale`` survives ``tree_flatten``/``jit``/``lax.scan``/``vmap``: it travels in the
  pytree's aux data. jmp dropped it there, so 30 non-finite steps inside ``jit`` ended at 1.0
  although eager code ended at the configured floor (google-deepmind/jmp#44, never merged).
- A float16 loss scale no longer crashes ``adjust`` (jmp#47: ``lax.select`` float32 vs float16);
  the scale keeps its dtype, and a growth that would overflow it is refused (2^15 stays 2^15 in f16).
- ``StaticLossScale`` built from a traced value inside ``jit`` raised nothing in jmp and leaked the
  tracer out of the function; here it says why it cannot work. Its scale is aux data, as in jmp.
- ``select_tree`` accepts Python and numpy bools and names the leaf whose dtypes or shapes differ;
  ``adjust`` and ``select_tree`` check their predicate with an error, not an ``assert`` (which
  ``python -O`` removes). The error is still an ``AssertionError`` subclass, as jmp's callers expect.
- The finiteness decision can be all-reduced: ``all_finite(tree, axis_name=...)`` under
  ``pmap``, ``shard_map`` or ``vmap(axis_name=...)``, so every replica skips together and the loss
  scale stays identical on all of them (with per-replica decisions it drifts apart, as flax's
  ``DynamicScale`` does under ``vmap``, flax#4114).

Added (as mixprec's torch ``GradScaler``): ``max_loss_scale`` (a ceiling; flax#2547 grew to inf
without one), ``hysteresis`` and ``consecutive_hysteresis`` (DeepSpeed's rule: an overflow lowers
the scale only after ``hysteresis`` overflows). With ``hysteresis > 1`` the remaining budget is a
third leaf, ``hysteresis_left``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from mixprec.jax.scale_values import _check_floor, _reciprocal, _strong, warn_if_not_floating

T = TypeVar("T")


class PredicateError(ValueError, AssertionError):
    """A predicate that is not a boolean scalar (an ``AssertionError`` too, as jmp raised one)."""


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


class _Static:
    """A concrete value held in a pytree's aux data: compared and hashed by value, so jit caches hit
    and two treedefs with the same configuration are equal."""

    __slots__ = ("value", "_key", "_hash")

    def __init__(self, value: Any) -> None:
        a = np.asarray(value)
        self.value = value
        self._key = (a.dtype.str, a.shape, a.tobytes())
        self._hash = hash(self._key)  # jit hashes the treedef at every call

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and (self is other or self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple[Any, Any]:
        return self.value, self._key

    def __setstate__(self, state: tuple[Any, Any]) -> None:
        self.value, self._key = state
        self._hash = hash(self._key)

    def __repr__(self) -> str:
        return repr(np.asarray(self.value).tolist())


def _static(value: Any, owner: str, field: str) -> _Static:
    if _is_tracer(value):
        raise TypeError(
            f"{owner}.{field} is configuration and must be a concrete value, got a traced one: create the "
            f"{owner} outside the jitted/vmapped function (or pass it in as an argument) rather than from a "
            "traced value"
        )
    return _Static(value)


def register_empty_pytree(cls: type) -> None:
    """Register ``cls`` as a pytree without leaves (the object itself is the aux data), as jmp does."""
    tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


def _new(cls: type, **fields: Any) -> Any:
    """Build a frozen dataclass without ``__post_init__``: jax unflattens with placeholder leaves
    (``object()``, ``None``, tracers) that must not be validated."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)  # a frozen dataclass's fields live in its __dict__ (no per-field setattr)
    return obj


_HYSTERESIS_LEFT: dict[int, np.ndarray] = {}


def _full_hysteresis(h: int) -> np.ndarray:
    """``np.full([], h, np.int32)``, one shared (never mutated) array per value: unflattening, which jit
    does at every call, should not allocate."""
    a = _HYSTERESIS_LEFT.get(h)
    if a is None:
        a = _HYSTERESIS_LEFT[h] = np.full([], h, np.int32)
        a.setflags(write=False)
    return a


class _Config:
    """A ``DynamicLossScale``'s configuration, its pytree aux data: one object per distinct configuration
    (``_config`` interns them), so the treedef hash and comparison jit does at every call are identity
    checks in C rather than Python ``__hash__``/``__eq__`` calls, and unflattening copies a prepared field
    dict. Its repr, part of ``str(treedef)`` (which checkpoints store), is the configuration tuple's."""

    __slots__ = ("key", "template", "extra_leaf", "__weakref__")

    def __init__(self, key: _Meta) -> None:
        period, factor, lo, hi, hysteresis, consecutive = key
        self.key = key
        self.extra_leaf = hysteresis > 1  # hysteresis_left is a leaf
        self.template = {
            "period": period, "factor": factor, "min_loss_scale": lo.value,
            "max_loss_scale": None if hi is None else hi.value, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive, "hysteresis_left": _full_hysteresis(hysteresis), "_aux": self,
        }

    def __iter__(self) -> Any:
        return iter(self.key)

    def __len__(self) -> int:
        return len(self.key)

    def __getitem__(self, i: Any) -> Any:
        return self.key[i]

    def __repr__(self) -> str:
        return repr(self.key)

    def __reduce__(self) -> tuple[Any, tuple[_Meta]]:
        return _config, (self.key,)


# Weak values: an entry lives as long as something holds its object (a loss scale, a treedef, jit's cache), so
# every live configuration has exactly one object, and configurations nobody uses any more are not kept.
_CONFIGS: weakref.WeakValueDictionary[_Meta, _Config] = weakref.WeakValueDictionary()


def _config(key: _Meta) -> _Config:
    """The one ``_Config`` for this configuration: compared by value here, once, not at every jit call."""
    c = _CONFIGS.get(key)
    if c is None:
        c = _CONFIGS[key] = _Config(key)
    return c


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No-op loss scale does nothing."""

    @property
    def loss_scale(self) -> int:
        return 1

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales and unscales by a fixed constant.

    The scale is configuration, held in the pytree's aux data (the pytree has no leaves, as jmp's),
    so it must be concrete: create it outside ``jit``.
    """

    loss_scale: Any

    def __post_init__(self) -> None:
        value = self.loss_scale
        if _is_tracer(value) or type(value) is object:
            return
        ok = isinstance(value, (int, float, np.number, np.ndarray, jax.Array)) and not isinstance(value, (bool, np.bool_))
        if ok:
            ok = np.issubdtype(np.asarray(value).dtype, np.floating) or np.issubdtype(np.asarray(value).dtype, np.integer)
        if not ok:
            raise TypeError(
                f"StaticLossScale: loss_scale must be a number or a float array (e.g. 2.0**15), got "
                f"{type(value).__name__} {value!r}"
            )

    def scale(self, tree: T) -> T:
        factor = _strong(self.loss_scale)
        return jax.tree_util.tree_map(lambda x: x * factor, tree)

    def unscale(self, tree: T) -> T:
        inv_loss_scale = _reciprocal(self.loss_scale)
        return jax.tree_util.tree_map(lambda x: x * inv_loss_scale, tree)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        del grads_finite
        return self


class _LeaflessAux:
    """The aux data of a loss scale without leaves (``NoOpLossScale``, ``StaticLossScale``): one object per
    distinct configuration, holding the instance that unflattening hands back. jit compares and hashes
    the treedef at every call; this compares by identity, in C. Its repr is the one ``str(treedef)`` (which
    checkpoints store) showed before: the ``NoOpLossScale()`` object's, or the static scale's value."""

    __slots__ = ("instance", "text", "_reduce", "__weakref__")

    def __init__(self, instance: Any, text: str, reduce: tuple[Any, tuple[Any, ...]]) -> None:
        self.instance, self.text, self._reduce = instance, text, reduce

    def __repr__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self._reduce


_STATIC_AUX: weakref.WeakValueDictionary[Any, _LeaflessAux] = weakref.WeakValueDictionary()  # as _CONFIGS


def _static_aux(value: Any) -> _LeaflessAux:
    """The one aux object for a static scale of this value (dtype, shape and bytes)."""
    key = _static(value, "StaticLossScale", "loss_scale")
    aux = _STATIC_AUX.get(key)
    if aux is None:
        instance = _new(StaticLossScale, loss_scale=value)
        aux = _STATIC_AUX[key] = _LeaflessAux(instance, repr(key), (_static_aux, (value,)))
        instance.__dict__["_aux"] = aux
    return aux


def _static_flatten(s: StaticLossScale) -> tuple[tuple[()], _LeaflessAux]:
    d = s.__dict__
    aux = d.get("_aux")
    if aux is None:  # cached: jit flattens its arguments at every call
        aux = d["_aux"] = _static_aux(s.loss_scale)
    return (), aux


def _static_unflatten(aux: Any, leaves: Any) -> StaticLossScale:
    if type(aux) is not _LeaflessAux:  # a _Static, from a treedef pickled before the aux was interned
        aux = _static_aux(aux.value)
    return aux.instance


def _bool_scalar(pred: Any, what: str) -> jax.Array:
    """``pred`` as a 0-d bool array; Python and numpy bools are accepted."""
    if isinstance(pred, (bool, np.bool_)):
        return jnp.asarray(pred)
    shape, dtype = getattr(pred, "shape", None), getattr(pred, "dtype", None)
    if shape != () or dtype != jnp.bool_:
        raise PredicateError(
            f"{what}: expected boolean scalar, got {type(pred).__name__} with shape {shape} and dtype {dtype}. "
            "Reduce per-leaf checks to one bool first, e.g. all_finite(grads); under vmap, pass axis_name to "
            "all_finite so every example shares one decision"
        )
    return pred


_Data = tuple[Any, ...]
_Meta = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scale (jmp's, plus a ceiling and hysteresis).

    Dynamic loss scaling tries to determine the largest loss scale value that will keep gradients
    finite. It increases the loss scale every ``period`` steps by ``factor`` if the grads remain
    finite, otherwise it reduces the loss scale by ``1 / factor`` and resets the counter::

        loss_scale = loss_scale.adjust(all_finite(grads))

    Args:
        loss_scale: the current scale (a float array; its dtype is kept, float16 included).
        counter: finite steps since the last change.
        period: finite steps before the scale grows (jmp: 2000, as torch's growth_interval).
        factor: growth factor; the backoff divides by it.
        min_loss_scale: the floor (jmp: 1). Kept through jit and flattening.
        max_loss_scale: the ceiling (None: none; a growth that would overflow the dtype is always refused).
        hysteresis: overflows tolerated before the scale is lowered (1: jmp's and torch's behaviour).
        consecutive_hysteresis: refill the hysteresis budget on every finite step (only back-to-back
            overflows lower the scale); otherwise it refills when the scale grows.
        hysteresis_left: the remaining budget (default ``hysteresis``); a leaf when hysteresis > 1.
    """

    loss_scale: Any
    counter: Any = dataclasses.field(default_factory=lambda: np.zeros([], np.int32))
    period: int = 2000
    factor: int = 2
    min_loss_scale: Any = dataclasses.field(default_factory=lambda: np.ones([], np.float32))
    max_loss_scale: Any = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    hysteresis_left: Any = None

    def __post_init__(self) -> None:
        value = self.loss_scale
        if isinstance(value, (str, bytes, bool, np.bool_, list, tuple, dict)) or value is None:
            raise TypeError(
                f"DynamicLossScale: loss_scale must be a float scalar or array, e.g. jnp.float32(2**15), got "
                f"{type(value).__name__} {value!r}"
            )
        if isinstance(value, int):
            # a Python int (2**15) counts as float32, as for scale/unscale: int32 arithmetic in adjust wrapped the
            # grown scale past 2**31 to a negative number, then to 0 (every later step unscaled by 1/0)
            object.__setattr__(self, "loss_scale", np.asarray(value, np.float32))
        warn_if_not_floating(self.loss_scale, "loss_scale")
        warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
        _static(self.min_loss_scale, "DynamicLossScale", "min_loss_scale")
        if self.max_loss_scale is not None:
            _static(self.max_loss_scale, "DynamicLossScale", "max_loss_scale")
        if not isinstance(self.hysteresis, (int, np.integer)) or isinstance(self.hysteresis, bool) or self.hysteresis < 1:
            raise ValueError(f"DynamicLossScale: hysteresis must be an integer >= 1 (1 = no hysteresis), got {self.hysteresis!r}")
        object.__setattr__(self, "hysteresis", int(self.hysteresis))
        object.__setattr__(self, "consecutive_hysteresis", bool(self.consecutive_hysteresis))
        if self.hysteresis_left is None:
            object.__setattr__(self, "hysteresis_left", np.full([], self.hysteresis, np.int32))
        period = self.period
        if isinstance(period, (float, np.floating)) and float(period).is_integer():
            period = int(period)  # 2000.0: a float period would turn the int32 counter into a float (lax.scan refuses the carry)
        if isinstance(period, (bool, np.bool_)) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"DynamicLossScale: period must be a whole, positive number of steps, got {self.period!r}")
        object.__setattr__(self, "period", int(period))
        if not (isinstance(self.factor, (int, float, np.number)) and self.factor > 1):
            raise ValueError(
                f"DynamicLossScale: factor must be > 1, got {self.factor!r} (a factor of 1 never changes the scale: "
                "use StaticLossScale)"
            )
        lo = np.asarray(self.min_loss_scale, np.float64)
        concrete = type(self.loss_scale) is not object and not _is_tracer(self.loss_scale)
        if concrete:
            _check_floor(self.loss_scale, lo)
        if self.max_loss_scale is not None:
            hi = np.asarray(self.max_loss_scale, np.float64)
            if not (hi >= lo).all():
                raise ValueError(f"DynamicLossScale: max_loss_scale ({hi.tolist()}) is below min_loss_scale ({lo.tolist()})")
            # a batch of scales (one per vmapped replica, say) is checked element by element
            if concrete:
                scale = np.asarray(self.loss_scale, np.float64)
                if (scale > hi).any():
                    raise ValueError(
                        f"DynamicLossScale: loss_scale ({scale.tolist()}) is above max_loss_scale ({hi.tolist()})"
                    )

    def scale(self, tree: T) -> T:
        factor = _strong(self.loss_scale)
        return jax.tree_util.tree_map(lambda x: x * factor, tree)

    def unscale(self, tree: T) -> T:
        inv_loss_scale = _reciprocal(self.loss_scale)
        return jax.tree_util.tree_map(lambda x: x * inv_loss_scale, tree)

    def _meta(self) -> _Config:
        hi = None if self.max_loss_scale is None else _static(self.max_loss_scale, "DynamicLossScale", "max_loss_scale")
        return _config((self.period, self.factor, _static(self.min_loss_scale, "DynamicLossScale", "min_loss_scale"), hi,
                        self.hysteresis, self.consecutive_hysteresis))

    def tree_flatten(self) -> tuple[_Data, _Config]:
        return _flatten_dynamic(self)

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], _Config]:
        data, meta = _flatten_dynamic(self)
        names = ("loss_scale", "counter", "hysteresis_left")
        return tuple((tree_util.GetAttrKey(n), v) for n, v in zip(names, data)), meta

    @classmethod
    def tree_unflatten(cls, meta: _Config, data: _Data) -> DynamicLossScale:
        return _unflatten_dynamic(meta, data)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the next state dependent on whether grads are finite."""
        grads_finite = _bool_scalar(grads_finite, "DynamicLossScale.adjust(grads_finite)")
        scale = jnp.asarray(self.loss_scale)
        dtype = scale.dtype
        # the bounds in the scale's own dtype: jmp mixed a float32 floor into a float16 scale (jmp#47)
        floor = jnp.asarray(np.asarray(self.min_loss_scale), dtype)
        at_period = self.counter == (self.period - 1)
        grown = scale * self.factor
        if self.max_loss_scale is not None:
            grown = jnp.minimum(grown, jnp.asarray(np.asarray(self.max_loss_scale), dtype))
        # never grow into inf, nor (an integer scale, which jmp only warns about) wrap past its dtype's maximum
        grown = jnp.where(jnp.isfinite(grown) & (grown >= scale), grown, scale)
        lowered = jnp.maximum(floor, scale / self.factor)
        hysteresis_left = self.hysteresis_left
        if self.hysteresis > 1:
            left = jnp.asarray(self.hysteresis_left)
            lower = ~grads_finite & (left <= 1)
            refill = grads_finite if self.consecutive_hysteresis else grads_finite & at_period
            hysteresis_left = jnp.where(
                ~grads_finite & (left > 1), left - 1, jnp.where(refill, jnp.full_like(left, self.hysteresis), left)
            )
        else:
            lower = ~grads_finite
        new_scale = jnp.where(grads_finite, jnp.where(at_period, grown, scale), jnp.where(lower, lowered, scale))
        counter = ((self.counter + 1) % self.period) * grads_finite
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(loss_scale=new_scale.astype(dtype), counter=counter, hysteresis_left=hysteresis_left)
        if "_aux" in self.__dict__:
            fields["_aux"] = self.__dict__["_aux"]  # the same configuration
        return _new(type(self), **fields)  # validated when built; jit must not re-check traced values


def _noop_aux() -> _LeaflessAux:
    return _NOOP_AUX  # what a pickled NoOpLossScale treedef's aux unpickles to


_NOOP = NoOpLossScale()
_NOOP_AUX = _LeaflessAux(_NOOP, repr(_NOOP), (_noop_aux, ()))
tree_util.register_pytree_node(NoOpLossScale, lambda s: ((), _NOOP_AUX), lambda aux, _: _NOOP)
tree_util.register_pytree_node(StaticLossScale, _static_flatten, _static_unflatten)


def _flatten_dynamic(s: DynamicLossScale) -> tuple[_Data, _Config]:
    # jit runs this for every argument at every call: plain dict reads, no method calls
    d = s.__dict__
    meta = d.get("_aux")
    if meta is None:  # cached on the object: the meta is configuration
        meta = d["_aux"] = s._meta()
    if meta.extra_leaf:
        return (d["loss_scale"], d["counter"], d["hysteresis_left"]), meta
    return (d["loss_scale"], d["counter"]), meta


def _unflatten_dynamic(meta: _Config, data: _Data) -> DynamicLossScale:
    if type(meta) is not _Config:  # a plain configuration tuple
        meta = _config(tuple(meta))
    obj = _object_new(DynamicLossScale)
    d = obj.__dict__
    d.update(meta.template)
    d["loss_scale"], d["counter"] = data[0], data[1]
    if meta.extra_leaf:
        d["hysteresis_left"] = data[2]
    return obj


_object_new = object.__new__
tree_util.register_pytree_with_keys(
    DynamicLossScale,
    lambda s: s.tree_flatten_with_keys(),
    _unflatten_dynamic,
    _flatten_dynamic,
)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """Returns a scalar ndarray indicating whether the input arrays are finite.

    With ``axis_name`` (inside ``pmap``, ``shard_map`` or ``vmap(axis_name=...)``) the answer is
    all-reduced over that axis: True only when every replica's arrays are finite.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        finite = jnp.array(True)
    else:
        finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    if axis_name is not None:
        finite = jax.lax.psum((~finite).astype(jnp.int32), axis_name) == 0
    return finite


def select_tree(pred: Any, a: T, b: T) -> T:
    """Selects a pytree based on the given predicate: ``a`` where ``pred`` is True, else ``b``."""
    pred = _bool_scalar(pred, "select_tree(pred, a, b)")

    def select(path: Any, x: Any, y: Any) -> Any:
        x_dtype, y_dtype = jnp.result_type(x), jnp.result_type(y)
        if x_dtype != y_dtype or jnp.shape(x) != jnp.shape(y):
            raise TypeError(
                f"select_tree: leaf {tree_util.keystr(path) or '(root)'} is {x_dtype}{list(jnp.shape(x))} in the first "
                f"tree and {y_dtype}{list(jnp.shape(y))} in the second; both trees need the same dtypes and shapes "
                "(cast one, e.g. with Policy.cast_to_param, before selecting)"
            )
        return jax.lax.select(pred, x, y)

    return jax.tree_util.tree_map_with_path(select, a, b)
