"""The checks on an fp8 recipe's options (``mixprec.recipes.Fp8Spec``): every field's type and range.

Called by ``Fp8Spec.__post_init__``, so that a spec that cannot run as asked never exists: each
error names the field, what was given and what is allowed. Beyond the types and the choices:

- ``margin`` keeps a tensor's largest value at ``fp8_max * 2**-margin``; past ``max_margin`` it lands
  below e4m3's smallest normal (2**-6) and every cast loses its precision (a margin of 200 made
  ``2**-200`` underflow fp32: every scale 0, the loss NaN);
- ``amax_history_len``, ``amax_compute_algo`` and ``margin`` mean something only under delayed
  scaling, ``pow2_scales`` only under current scaling: set under another scaling they would be
  ignored, so they are refused;
- ``scaling`` is what an fp8 recipe's name says: options that change it would run another recipe
  under this one's name (``check_scaling``).
"""

from __future__ import annotations

import math
from typing import Any

from mixprec.formats import get_format

#: the allowed values of the choice fields
CHOICES = {"scaling": ("delayed", "current", "none"), "format": ("hybrid", "e4m3"),
           "granularity": ("tensorwise", "rowwise", "mx"), "amax_compute_algo": ("max", "most_recent"),
           "gemm": ("auto", "emulate", "scaled_mm")}
#: the fields only delayed scaling reads, and their defaults (TE's)
DELAYED_ONLY = {"amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0, "reduce_amax": True}
BOOLS = ("pow2_scales", "skip_first_last", "reduce_amax", "cache_weight")


def max_margin() -> int:
    """The largest margin that keeps ``fp8_max * 2**-margin`` at or above e4m3's smallest normal."""
    e4m3 = get_format("e4m3")
    return math.floor(math.log2(e4m3.max / e4m3.tiny))


def _int_at_least(field: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"fp8 {field} must be an integer >= {low}, got {v!r}")


def check_spec(spec: Any) -> None:
    """Raise ValueError / TypeError for a field of ``spec`` that is out of its range (see the module docstring)."""
    for field, allowed in CHOICES.items():
        if getattr(spec, field) not in allowed:
            raise ValueError(f"fp8 {field}={getattr(spec, field)!r}; expected one of {', '.join(allowed)}")
    for field in BOOLS:
        if not isinstance(getattr(spec, field), bool):
            raise TypeError(f"fp8 {field} must be True or False, got {getattr(spec, field)!r}")
    _int_at_least("amax_history_len", spec.amax_history_len, 1)
    _int_at_least("margin", spec.margin, 0)
    if spec.margin > max_margin():
        raise ValueError(f"fp8 margin={spec.margin}: the scale puts a tensor's largest value at fp8_max * 2**-margin, "
                         f"which past margin {max_margin()} is below e4m3's smallest normal (every cast would lose "
                         f"its precision, and from 2**-149 the scale is 0); use a margin from 0 (TE's default) "
                         f"to {max_margin()}")
    if spec.scaling != "delayed":
        set_ = [f for f, default in DELAYED_ONLY.items() if getattr(spec, f) != default]
        if set_:
            raise ValueError(f"fp8 {', '.join(set_)} {'apply' if len(set_) > 1 else 'applies'} to delayed scaling "
                             f"only; with scaling={spec.scaling!r} {'they' if len(set_) > 1 else 'it'} would be "
                             "ignored. Drop it, or use fp8-delayed")
    if spec.pow2_scales and spec.scaling != "current":
        raise ValueError(f"fp8 pow2_scales applies to current scaling only (it rounds the scale computed from the "
                         f"tensor being cast); with scaling={spec.scaling!r} it would be ignored. Drop it, or use "
                         "fp8-current")
    if spec.granularity == "rowwise" and spec.scaling != "current":
        raise ValueError(f"fp8 rowwise scaling needs scaling='current' (a scale per row of the tensor being "
                         f"cast), not {spec.scaling!r}")
    if spec.granularity == "mx" and (spec.scaling != "current" or spec.pow2_scales):
        raise ValueError(f"fp8 granularity='mx' (MXFP8: a power-of-two scale per 32-element block, from the block "
                         f"itself) needs scaling='current' and no pow2_scales (its scales are powers of two "
                         f"already), not scaling={spec.scaling!r}, pow2_scales={spec.pow2_scales!r}")
    if isinstance(spec.exclude, str) or not all(isinstance(e, str) for e in spec.exclude):
        raise TypeError(f"fp8 exclude must be a tuple of glob patterns (strings), got {spec.exclude!r}")


def check_options(scaling: str, options: dict[str, Any]) -> None:
    """``MixedPrecision(fp8={...})``: a delayed-only field given for a recipe that does not scale
    with delay is refused even at its default value (asking for it means expecting it to act)."""
    given = [f for f in DELAYED_ONLY if f in options]
    if scaling != "delayed" and given:
        raise ValueError(f"fp8 {', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to delayed scaling only; "
                         f"with scaling={scaling!r} {'they' if len(given) > 1 else 'it'} would be ignored. Drop "
                         "it, or use fp8-delayed")


#: the registered recipe of each scaling
RECIPE_OF = {"current": "fp8-current", "delayed": "fp8-delayed", "none": "fp8-unscaled"}


def check_scaling(recipe: Any, spec: Any) -> None:
    """``MixedPrecision(recipe, fp8=...)``: options may tune the recipe's scaling, not replace it
    (``fp8-current`` with ``scaling="none"`` trained the unsafe baseline under the recommended name)."""
    have = recipe.fp8.scaling
    if spec.scaling != have:
        other = RECIPE_OF.get(spec.scaling, spec.scaling)
        raise ValueError(f"fp8 scaling={spec.scaling!r} under recipe {recipe.name!r} (scaling={have!r}) would run "
                         f"{other}'s scaling under the name {recipe.name!r}, and every report would say "
                         f"{recipe.name}. Use MixedPrecision({other!r}, fp8=...) with the other options, or a Recipe "
                         "of your own with a name of its own (dataclasses.replace(mixprec.get_recipe(...), "
                         "name=..., fp8=...))")
