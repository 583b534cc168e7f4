"""fp8 training: ``nn.Linear`` layers computing in fp8 with per-tensor (or rowwise) scaling.

A capability: the recipes ``fp8-current`` (``"fp8"``), ``fp8-delayed`` and ``fp8-unscaled`` switch it
on, and ``MixedPrecision`` calls it (``prepare`` swaps the layers, ``step`` advances delayed scaling,
``state_dict`` carries its state). docs/fp8.md describes the numerics and the choices.

- ``casts``: amax, the two scale formulas, saturating casts, SQNR.
- ``delayed``: Transformer Engine's amax history and scale update, skip-aware, on the device.
- ``gemm``: the three GEMMs from fp8 operands (exact emulation, or ``torch._scaled_mm``).
- ``linear``: ``Fp8Linear`` (and ``Fp8Matmul``, what every fp8 layer shares) and its autograd function.
- ``conv1d``: Hugging Face's ``Conv1D`` (GPT-2's projections) in fp8.
- ``swap``: which layers, the swap, ``remove_fp8``.
- ``state``: ``Fp8Training``, what ``MixedPrecision`` holds.
- ``observe``: ``CastObserver``, per-cast statistics for diagnostics.
"""

from mixprec.fp8.casts import ROLES, amax, current_scale, delayed_scale, dequantize, quantize, role_formats, sqnr_db
from mixprec.fp8.linear import Fp8Config, Fp8Linear, Fp8Matmul
from mixprec.fp8.observe import CastObserver, CastStats, preserve_scaling_state
from mixprec.fp8.state import Fp8Error, Fp8Training, Fp8Warning
from mixprec.fp8.swap import Decision, decide, fp8_layers, remove_fp8

__all__ = [
    "ROLES", "CastObserver", "CastStats", "Decision", "Fp8Config", "Fp8Error", "Fp8Linear", "Fp8Matmul", "Fp8Training",
    "Fp8Warning",
    "amax", "current_scale", "decide", "delayed_scale", "dequantize", "fp8_layers", "preserve_scaling_state",
    "quantize", "remove_fp8", "role_formats", "sqnr_db",
]
