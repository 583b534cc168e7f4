"""Precision probes: measure, on your model, what fp16 / bf16 / fp8 would do to it."""

from mixprec.diagnostics.probes.activations import ActivationRangeReport, RangeEntry, probe_activation_range
from mixprec.diagnostics.probes.gradients import GradStats, GradUnderflowReport, Landing, probe_grad_underflow
from mixprec.diagnostics.probes.updates import ParamUpdate, UpdateVanishingReport, probe_update_vanishing

__all__ = [
    "ActivationRangeReport", "GradStats", "GradUnderflowReport", "Landing", "ParamUpdate", "RangeEntry",
    "UpdateVanishingReport", "probe_activation_range", "probe_grad_underflow", "probe_update_vanishing",
]
