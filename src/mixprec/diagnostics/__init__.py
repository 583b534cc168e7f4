"""Diagnostics: where mixed precision breaks on your model, and why.

- ``nan_guard``: names the module and op that produced the first NaN/Inf, forward and backward.
- probes: gradient underflow against fp16/bf16/fp8 ranges (``probe_grad_underflow``), updates that
  vanish without fp32 master weights (``probe_update_vanishing``), activations near fp16's maximum
  (``probe_activation_range``).
- ``ScaleMonitor`` / ``diagnose_scale``: healthy loss-scale probing or collapse, and which
  parameters overflowed.
- ``mixprec.doctor`` (``mixprec.diagnostics.doctor.doctor``): the debugging checklist on a task,
  with a report (``mixprec doctor``).

Names are imported lazily, so ``mixprec.diagnostics.cli`` (and ``mixprec --help``) loads no torch.
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AllowRule": "mixprec.diagnostics.guard",
    "NanGuard": "mixprec.diagnostics.guard",
    "NonFiniteError": "mixprec.diagnostics.events",
    "NonFiniteEvent": "mixprec.diagnostics.events",
    "NonFiniteWarning": "mixprec.diagnostics.events",
    "nan_guard": "mixprec.diagnostics.guard",
    "probe_activation_range": "mixprec.diagnostics.probes.activations",
    "probe_grad_underflow": "mixprec.diagnostics.probes.gradients",
    "probe_update_vanishing": "mixprec.diagnostics.probes.updates",
    "ScaleDiagnosis": "mixprec.diagnostics.scale_monitor",
    "ScaleMonitor": "mixprec.diagnostics.scale_monitor",
    "diagnose_scale": "mixprec.diagnostics.scale_monitor",
    "DoctorReport": "mixprec.diagnostics.doctor_report",
    "Finding": "mixprec.diagnostics.findings",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
