"""Mixed-precision policies for JAX: jmp's ``Policy`` and string grammar, with its parsing bugs fixed.

The layout and names are jmp's (``jmp._src.policy``): ``Policy``, ``get_policy``, ``parse_dtype``,
``half_dtype``, ``cast_to_full``, ``cast_to_half``, ``dtype_to_names``, ``name_to_dtype``.
Behaviour is jmp's wherever jmp is not wrong:

- grammar: ``"p=f32,c=bf16,o=f32"`` (keys ``p``/``params``, ``c``/``compute``, ``o``/``output``;
  params default to f32, compute to params, output to compute) or one dtype for all three;
- ``half`` is bf16 on TPU and f16 elsewhere, as in jmp (``half_dtype()``);
- only float arrays (numpy or jax) are cast; ints, bools, Python scalars, numpy scalars and other
  objects pass through untouched;
- ``str(policy)`` uses jmp's first names (``"p=full,c=bf16,o=full"``), which both this module and
  the torch side's ``mixprec.get_policy`` parse back.

Fixed: whitespace and case (``"P=F32, c=BF16"``), the common spellings jmp refuses (``fp32``,
``fp16``, ``float``, ...: every name ``mixprec.formats`` accepts), errors that name the bad token,
the input and what is allowed (jmp gave bare tuple-unpacking errors for ``"p=f32,"`` and
``"p=f32=x"``), a key given twice (jmp silently kept the last), and ``str(Policy)`` of numpy dtypes
(jmp raised ``KeyError: dtype('float32')``).

>>> policy = get_policy("params=float32, compute=BF16, output=float32")
>>> str(policy)
'p=full,c=bf16,o=full'
>>> policy.cast_to_compute({"w": np.ones(2, np.float32), "step": np.int32(3)})["w"].dtype
dtype(bfloat16)
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

_KEYS = {"p": "param_dtype", "params": "param_dtype",
         "c": "compute_dtype", "compute": "compute_dtype",
         "o": "output_dtype", "output": "output_dtype"}
_EXAMPLE = "e.g. 'p=f32,c=bf16,o=f32' or 'bf16'"


def _cast_floating_to(tree: T, dtype: Any) -> T:
    def conditional_cast(x: Any) -> Any:
        if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return x

    return jax.tree_util.tree_map(conditional_cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Encapsulates casting for inputs, outputs and parameters (jmp's ``Policy``).

    The dtypes are kept as given (``jnp.bfloat16``, ``np.dtype("float32")``, ...), as in jmp.
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def cast_to_param(self, x: T) -> T:
        """Converts floating point values to the param dtype."""
        return _cast_floating_to(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Converts floating point values to the compute dtype."""
        return _cast_floating_to(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Converts floating point values to the output dtype."""
        return _cast_floating_to(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return f"p={dtype_name(self.param_dtype)},c={dtype_name(self.compute_dtype)},o={dtype_name(self.output_dtype)}"


def dtype_name(dtype: Any) -> str:
    """jmp's first name for a dtype (``full``, ``bf16``, ``f16``, ``f64``), for any spelling of it:
    ``jnp.float32``, ``np.float32``, ``np.dtype("float32")``, ``"float32"``. Other dtypes keep numpy's
    name (``float8_e4m3fn``)."""
    canonical = jnp.dtype(dtype)
    for key, names in dtype_to_names.items():
        if jnp.dtype(key) == canonical:
            return names[0]
    return canonical.name


def policy_label(policy: Policy) -> str:
    """The policy in the torch side's spelling (``p=f32,c=bf16,o=f32``), for reports shared by both sides;
    ``str(policy)`` keeps jmp's (``p=full,...``)."""
    name = lambda d: "f32" if dtype_name(d) == "full" else dtype_name(d)  # noqa: E731
    return f"p={name(policy.param_dtype)},c={name(policy.compute_dtype)},o={name(policy.output_dtype)}"


def get_policy(policy_name: str) -> Policy:
    """Returns a mixed precision policy parsed from a string (jmp's grammar; see the module docstring).

    Raises ``ValueError`` naming the bad token, the input and what is allowed.
    """
    if isinstance(policy_name, Policy):
        return policy_name
    if not isinstance(policy_name, str):
        raise TypeError(f"get_policy expects a policy string ({_EXAMPLE}), got {type(policy_name).__name__}")
    text = policy_name.strip()
    if not text:
        raise ValueError(f"Empty policy string {policy_name!r}; expected {_EXAMPLE}")
    if "=" not in text:
        # one dtype (e.g. 'f32' or 'half') for all three components
        dtype = _parse_in(text, policy_name)
        return Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype)

    found: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for index, raw in enumerate(policy_name.split(",")):
        part = raw.strip()
        if not part:
            where = "a trailing comma" if index == policy_name.count(",") else f"an empty entry (#{index + 1})"
            raise ValueError(
                f"Policy {policy_name!r} has {where}; expected key=dtype entries separated by single commas, {_EXAMPLE}"
            )
        if part.count("=") != 1:
            raise ValueError(
                f"Malformed entry {part!r} in policy {policy_name!r}: expected exactly one '=' as in key=dtype "
                f"(keys p/params, c/compute, o/output), {_EXAMPLE}"
            )
        key, value = (s.strip() for s in part.split("="))
        field = _KEYS.get(key.lower())
        if field is None:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy_name!r}; expected one of p, params, c, compute, o, output"
            )
        if field in found:
            raise ValueError(
                f"Key {key!r} in policy {policy_name!r} sets the {field.split('_')[0]} dtype that {spelled[field]!r} "
                "already set; give each of params, compute and output at most once"
            )
        found[field], spelled[field] = _parse_in(value, policy_name), key
    param_dtype = found.get("param_dtype", jnp.float32)
    compute_dtype = found.get("compute_dtype", param_dtype)
    output_dtype = found.get("output_dtype", compute_dtype)
    return Policy(param_dtype=param_dtype, compute_dtype=compute_dtype, output_dtype=output_dtype)


def _recipe_hint(name: str) -> str:
    """When a policy string looks like a recipe's name ("bf16-mixed"): where its policy is. (Read from the
    recipes module when it is loaded, by the name's shape otherwise: the recipes import this module.)"""
    import sys

    key = name.strip().lower()
    known = getattr(sys.modules.get("mixprec.jax.recipes"), "recipe_names", None)
    looks = key in known() if known is not None else ("-" in key and "=" not in key)
    return f". {name.strip()!r} is a recipe, not a policy: its policy is mixprec.jax.get_recipe({key!r}).policy" if looks else ""


def _parse_in(token: str, policy_name: str) -> Any:
    try:
        return parse_dtype(token)
    except ValueError:
        raise ValueError(
            f"Unknown dtype {token.strip()!r} in policy {policy_name!r}; expected one of {', '.join(accepted_dtype_names())} "
            "(any case)" + _recipe_hint(policy_name)
        ) from None


def cast_to_full(tree: T) -> T:
    """Ensures floating point leaves of the given tree are f32."""
    return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Ensures floating point leaves of the given tree are half precision."""
    return _cast_floating_to(tree, half_dtype())


def half_dtype() -> Any:
    """Returns the half precision dtype for the current backend: bf16 on TPU, f16 elsewhere (as jmp)."""
    device0 = jax.local_devices()[0]
    return jnp.bfloat16 if device0.platform == "tpu" else jnp.float16


dtype_to_names = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}

name_to_dtype = {name: dtype for dtype, names in dtype_to_names.items() for name in names}

# mixprec.formats' canonical names -> jax dtypes. The formats table decides which spellings mean
# which format (fp32, float, fp16, e4m3, ...); this only maps its answer onto jax.
_FORMAT_TO_JAX = {
    "f64": jnp.float64, "f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16,
    "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2,
}


def accepted_dtype_names() -> list[str]:
    """Every dtype name ``parse_dtype`` accepts (case-insensitively)."""
    from mixprec.formats import accepted_names

    return sorted({"half", *name_to_dtype, *accepted_names()})


def parse_dtype(value: str) -> Any:
    """Parses a string representing a dtype into a dtype object (``jnp.float32``, ``jnp.bfloat16``, ...).

    jmp's names first (``half`` follows the backend), then every spelling ``mixprec.formats``
    accepts; surrounding whitespace and case are ignored.
    """
    if not isinstance(value, str):
        raise TypeError(f"parse_dtype expects a dtype name such as 'bf16', got {type(value).__name__}")
    key = value.strip().lower()
    if key == "half":
        return half_dtype()
    if key in name_to_dtype:
        return name_to_dtype[key]
    from mixprec.formats import get_format  # the one table of names; imported only for other spellings

    try:
        return _FORMAT_TO_JAX[get_format(key).name]
    except ValueError:
        raise ValueError(
            f"Unknown dtype {value!r}; expected one of {', '.join(accepted_dtype_names())} (any case)"
        ) from None
