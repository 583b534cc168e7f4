"""Checkpoints of pytrees (parameters, optimizer states, loss scales) that resume bit for bit.

``save_tree(path, tree)`` writes one ``.npz`` file: every leaf's bytes, plus the tree's structure
as text (which includes the loss scale's configuration: period, factor, floor, ceiling,
hysteresis). ``load_tree(path, like)`` rebuilds the tree in the structure of ``like`` (a freshly
initialised state) and refuses a checkpoint whose structure, configuration, leaf dtypes or shapes
differ, naming the first difference. No pickle: a checkpoint cannot run code.

Orbax and flax.serialization work too: every mixprec.jax object is a pytree of arrays whose
configuration lives in the tree structure, so restoring into a freshly built state restores it.

>>> import jax.numpy as jnp, tempfile, os
>>> from mixprec.jax import DynamicLossScale
>>> path = os.path.join(tempfile.mkdtemp(), "ls.npz")
>>> save_tree(path, DynamicLossScale(jnp.float32(1024.0), min_loss_scale=jnp.float32(2.0**-10)))
>>> float(load_tree(path, DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(2.0**-10))).loss_scale)
1024.0
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "mixprec-jax-tree"
VERSION = 1


def _paths_and_leaves(tree: Any) -> tuple[list[str], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) or "(root)" for p, _ in flat], [leaf for _, leaf in flat], treedef


def _raw(a: np.ndarray) -> np.ndarray:
    """Bytes numpy can store: bfloat16, float8 and int4 (ml_dtypes) as same-width unsigned integers.
    (``isbuiltin`` is 2 for those, not 1: float8_e5m2's kind is 'f', and written as is it would not load.)"""
    if a.dtype.kind in "biufc" and a.dtype.isbuiltin == 1:
        return a
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _structure(treedef: Any) -> str:
    """The tree's structure as text, without memory addresses: a flax ``TrainState`` keeps its
    ``apply_fn`` and ``tx`` functions as static fields, whose reprs name an address that differs in
    every process (so a resumed run's freshly built state never matched its checkpoint)."""
    return _ADDRESS.sub(" at 0x…", str(treedef))


def _is_key(x: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``; nnx ``Rngs`` and ``Dropout`` hold them)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _host(name: str, leaf: Any) -> tuple[np.ndarray, str, list[int]]:
    """A leaf as host bytes, the dtype name and shape stored for it (a key's: ``key<impl>`` and the key's shape;
    its bytes are the key data, with the implementation's trailing dimension)."""
    if _is_key(leaf):
        return np.asarray(jax.random.key_data(leaf)), str(leaf.dtype), list(leaf.shape)
    a = np.asarray(leaf)  # gathers device and sharded arrays to the host
    if a.dtype == object:
        raise TypeError(f"save_tree: leaf {name} is a {type(leaf).__name__}, not an array: it stores arrays and scalars "
                        "(keep functions and other objects out of the tree, or rebuild them on load)")
    return a, a.dtype.name, list(a.shape)


def save_tree(path: str | os.PathLike[str], tree: Any) -> None:
    """Write ``tree``'s leaves and structure to ``path`` (a ``.npz`` file; the suffix is not added).

    Atomic: the file is written beside ``path`` and renamed onto it once complete, so an interrupted
    save (Ctrl-C, a kill, a full disk) leaves the previous checkpoint at ``path`` whole."""
    names, leaves, treedef = _paths_and_leaves(tree)
    hosted = [_host(name, leaf) for name, leaf in zip(names, leaves)]
    arrays = [a for a, _, _ in hosted]
    meta = {
        "format": FORMAT, "version": VERSION, "treedef": _structure(treedef), "paths": names,
        "dtypes": [d for _, d, _ in hosted], "shapes": [shape for _, _, shape in hosted],
    }
    payload = {f"leaf_{i:06d}": _raw(a) for i, a in enumerate(arrays)}
    target = os.fspath(path)
    tmp = os.path.join(os.path.dirname(target) or ".", f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _python_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


_KINDS = {bool: "b", int: "iu", float: "f", complex: "c"}


def _same_kind(dtype_name: str, like: Any) -> bool:
    """A Python number in ``like`` takes a saved scalar of its kind in any width: flax's
    ``TrainState.create`` sets ``step=0``, a jitted ``apply_gradients`` makes it an int32 array."""
    try:
        kind = np.dtype(dtype_name).kind
    except TypeError:  # bfloat16 and other ml_dtypes names: not a Python number's
        return False
    return kind in _KINDS[type(like)]


def _restore_like(value: np.ndarray, like: Any, dtype_name: str) -> Any:
    if _python_number(like):
        if dtype_name == np.asarray(like).dtype.name:
            return type(like)(value.item())
        return jnp.asarray(value)  # saved from a traced step: the array it was
    if isinstance(like, np.ndarray):
        return value.copy()
    if isinstance(like, np.generic):
        return value[()]
    sharding = getattr(like, "sharding", None)  # back where `like` lives: across its devices, not all on one
    if _is_key(like):
        key = jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(like))
        return key if sharding is None else jax.device_put(key, sharding)
    if getattr(like, "weak_type", False) and value.shape == () and jnp.asarray(value.item()).dtype == value.dtype:
        out = jnp.asarray(value.item())  # a weakly typed scalar (from a Python number) stays weak: promotion depends on it
    else:
        out = jnp.asarray(value)
    return out if sharding is None else jax.device_put(out, sharding)


def _like_dtype(like: Any) -> tuple[str, tuple[int, ...], np.dtype]:
    """The dtype name (as save_tree stores it), shape and storage dtype of a leaf of ``like``."""
    if _is_key(like):
        data = jax.eval_shape(jax.random.key_data, like)
        return str(like.dtype), tuple(like.shape), np.dtype(data.dtype)
    want = np.asarray(like)
    return want.dtype.name, want.shape, want.dtype


def _damaged(path: Any, e: BaseException) -> ValueError:
    what = "not a .npz file (not a zip archive)" if isinstance(e, zipfile.BadZipFile) or "pickle" in str(e) else \
        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'incomplete'}"
    return ValueError(f"{os.fspath(path)!r} cannot be read as a mixprec.jax checkpoint: {what}. It is damaged "
                      "(truncated or overwritten) or another kind of file; load an earlier checkpoint")


def load_tree(path: str | os.PathLike[str], like: Any, *, strict: bool = True) -> Any:
    """Read a tree written by ``save_tree`` into the structure of ``like``.

    ``strict=False`` accepts a different structure text when the leaves still line up (same number,
    dtypes and shapes): the configuration held in ``like`` then wins.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            if "__meta__" not in data:
                raise ValueError(f"{os.fspath(path)!r} is not a mixprec.jax checkpoint (no __meta__ entry); write it "
                                 "with save_tree")
            meta = json.loads(bytes(data["__meta__"]).decode())
            stored = [data[f"leaf_{i:06d}"] for i in range(len(meta["paths"]))]
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except ValueError as e:
        if "is not a mixprec.jax checkpoint" in str(e):
            raise
        raise _damaged(path, e) from None
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise _damaged(path, e) from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a mixprec.jax checkpoint (format {meta.get('format')!r})")
    names, like_leaves, treedef = _paths_and_leaves(like)
    if strict and _ADDRESS.sub(" at 0x…", meta["treedef"]) != _structure(treedef):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was saved from a different tree or configuration than `like`:\n"
            f"  saved: {meta['treedef']}\n  like:  {treedef}\n"
            "build `like` with the same optimizer, recipe and loss-scale settings (or pass strict=False to keep "
            "like's configuration)"
        )
    if len(stored) != len(like_leaves):
        raise ValueError(f"checkpoint {os.fspath(path)!r} holds {len(stored)} leaves, `like` has {len(like_leaves)}")
    restored = []
    for name, saved_name, dtype_name, shape, raw, like_leaf in zip(names, meta["paths"], meta["dtypes"], meta["shapes"],
                                                                    stored, like_leaves):
        like_name, like_shape, storage = _like_dtype(like_leaf)
        python_scalar = _python_number(like_leaf) and _same_kind(dtype_name, like_leaf)
        if (dtype_name != like_name and not python_scalar) or tuple(shape) != like_shape:
            raise ValueError(
                f"checkpoint leaf {saved_name} is {dtype_name}{shape} but `like` has {name} as "
                f"{like_name}{list(like_shape)}"
            )
        if python_scalar and dtype_name != like_name:
            storage = np.dtype(dtype_name)
        value = raw.view(storage) if raw.dtype != storage else raw
        restored.append(_restore_like(value if _is_key(like_leaf) else value.reshape(like_shape), like_leaf, dtype_name))
    return jax.tree_util.tree_unflatten(treedef, restored)
