"""The fp8 weight cast, cached across the micro-batches of one accumulation window.

The weights only change at an optimizer step, so within an accumulation window every forward
casts the same weight to the same fp8 bits with the same scale. An fp8 layer keeps its last forward cast (bits, scale and, for delayed scaling, the weight's amax) and
reuses it while it is valid, which is checked, not assumed:

- the weight's version counter and storage (every in-place change, an optimizer step or a
  ``load_state_dict``, bumps the version; a moved or replaced weight has another storage);
- for delayed scaling, the version of the layer's scales (the update and a loaded state bump it);
- only a forward that will run a backward (grad enabled, as an accumulation window's micro-batches
  are) keeps or reuses a cast; an evaluation under ``torch.no_grad()`` / ``torch.inference_mode()``
  casts every time. A write through ``weight.data`` (``p.data.copy_(ema)``, ``.data.normal_()``)
  bumps no version the layer can see: swapping EMA weights in for an eval loop that way, or
  evaluating the raw weights and then the EMA ones, reused the first weights' cast, silently;
- ``Fp8Training.after_step`` drops every layer's cast at each optimizer step, so that at most one
  window holds it (1 byte per fp8 weight element) and nothing outlives the step that made it.

The reuse is bit for bit what casting again gives (tested). Under ``torch.compile`` nothing is
cached (the compiled graph casts every time). Tensorwise and rowwise scaling cache the forward
cast; a tensorwise backward reuses it (it is saved), rowwise's backward casts along ``out`` again,
and MXFP8 casts every time. ``Fp8Spec.cache_weight=False`` switches the cache off.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.fp8.casts import amax_fmax
from mixprec.fp8.casts import quantize_raw as quantize
from mixprec.fp8.fsdp import gathered

ATTR = "_fp8_weight_cache"


def cast_weight(layer: Any, weight: torch.Tensor, cfg: Any, scales: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(w_q, sw, amax)`` for the layer's forward: the cached cast when it is still valid, else a new
    one (kept for the next micro-batch when the cache is on)."""
    bits = gathered(weight)  # FSDP2's fp8 all-gather made the cast already (``mixprec.fp8.fsdp``)
    if bits is not None:
        return (*bits, None)
    # (a forward without grad is an evaluation, where a ``.data`` swap of weights is common: see above)
    caching = cfg.cache_weight and torch.is_grad_enabled() and not torch.compiler.is_compiling()
    token = (weight._version, weight.data_ptr(), None if scales is None else scales._version) if caching else None
    held = layer.__dict__.get(ATTR)
    if held is not None and held[0] == token:
        return held[1:]
    with torch.no_grad():
        sw = cfg.scale(weight, 1, -1, scales)
        # (``contiguous``: a transposed weight, Conv1D's, gives the bits nn.Linear's layout; a no-op otherwise)
        cast = (quantize(weight, sw, cfg.formats[1]).contiguous(), sw,
                amax_fmax(weight) if cfg.scaling == "delayed" else None)
    if caching:
        layer.__dict__[ATTR] = (token, *cast)
    return cast


def clear(layer: Any) -> None:
    """Drop the layer's cached cast (at every optimizer step)."""
    layer.__dict__.pop(ATTR, None)
