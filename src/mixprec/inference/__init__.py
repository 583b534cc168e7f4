"""Low-precision inference: cast a trained fp32 model to bf16 or fp16, and check it against fp32.

- ``cast_for_inference(model, "bf16")``: a copy with parameters in 16 bits (``mode="storage"``)
  or fp32 under autocast (``mode="autocast"``), with the training recipes' fp32 islands (norms)
  and fp32 parameters; it runs its own autocast, so ``lp(x)`` needs no context.
- ``check_inference(model, batches, "both")``: the fp32 model and each cast on the same batches:
  SQNR, max abs / relative error, top-1 / top-k agreement for class scores, a verdict (agree,
  degraded, broken: ``Thresholds``) and where it fails (the first module whose output went
  non-finite, fp16 overflow, the first module whose error passes the gate).
- ``mixprec infer-check``: the same on a task (``mixprec.inference.cli``).

Names are imported lazily, so ``mixprec.inference.cli`` (and ``mixprec --help``) loads no torch.
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CastInfo": "mixprec.inference.cast",
    "cast_for_inference": "mixprec.inference.cast",
    "cast_info": "mixprec.inference.cast",
    "recipe_for": "mixprec.inference.cast",
    "DtypeResult": "mixprec.inference.check",
    "InferenceCheckError": "mixprec.inference.check",
    "InferenceReport": "mixprec.inference.check",
    "check_inference": "mixprec.inference.check",
    "Failure": "mixprec.inference.locate",
    "ModuleError": "mixprec.inference.locate",
    "NearOverflow": "mixprec.inference.locate",
    "OutputStats": "mixprec.inference.metrics",
    "Thresholds": "mixprec.inference.verdict",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
