"""``Fp8Training``: what ``MixedPrecision`` holds for an fp8 recipe, and the three points where it acts.

- ``prepare``: ``Fp8Training.attach`` swaps the eligible linears (``swap``) and keeps the decisions;
  a model with no eligible linear gets an ``Fp8Warning`` (it then trains as bf16-mixed).
- ``step``: ``after_step(skipped)`` ends the step of delayed scaling (``delayed.update``); the skip
  flag stays on the device.
- ``state_dict``: each delayed-scaling layer's history and scales, by qualified name, so that a
  resumed run continues bit for bit. Current scaling keeps no state.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from mixprec.fp8 import delayed
from mixprec.fp8.swap import Decision, backend_for, fp8_layers, swap


class Fp8Warning(UserWarning):
    """An fp8 recipe that cannot do what it says (no eligible layer, for one)."""


def describe_spec(spec: Any, backend: str | None = None) -> str:
    """One line: formats, scaling and GEMM."""
    fmt = "HYBRID (e4m3 fwd, e5m2 grads)" if spec.format == "hybrid" else "E4M3 (gradients too)"
    if spec.scaling == "delayed":
        how = f"delayed scaling, amax history {spec.amax_history_len} ({spec.amax_compute_algo}), margin {spec.margin}"
    elif spec.scaling == "current":
        how = f"current scaling ({spec.granularity})"
    else:
        how = "NO scaling (scale 1)"
    gemm = {"emulate": "emulated GEMMs (fp32)", "scaled_mm": "torch._scaled_mm"}.get(backend or "", f"gemm={spec.gemm}")
    return f"{fmt}, {how}{', power-of-two scales' if spec.pow2_scales else ''}; {gemm}"


def with_options(recipe: Any, options: Any) -> Any:
    """``recipe.fp8`` with ``options`` (a dict of ``Fp8Spec`` fields, or a whole ``Fp8Spec``) applied;
    the errors say what is allowed. (``MixedPrecision(..., fp8=options)``.)"""
    from mixprec.recipes import Fp8Spec

    if recipe.fp8 is None:
        raise ValueError(f"fp8= applies to fp8 recipes (fp8-current, fp8-delayed); {recipe.name!r} is not one")
    if isinstance(options, Fp8Spec):
        return options
    if not isinstance(options, dict):
        raise TypeError(f"fp8 options are a dict of Fp8Spec fields or an Fp8Spec, got {type(options).__name__}")
    fields = [f.name for f in dataclasses.fields(Fp8Spec)]
    if set(options) - set(fields):
        raise ValueError(f"unknown fp8 option(s) {sorted(set(options) - set(fields))}; expected some of {', '.join(fields)}")
    return dataclasses.replace(recipe.fp8, **options)


def load_fp8_state(fp8: "Fp8Training | None", state: dict[str, Any] | None) -> None:
    """``MixedPrecision.load_state_dict``'s fp8 part: refuses fp8 state before ``prepare``."""
    if fp8 is None:
        if state and state.get("layers"):
            raise RuntimeError("the checkpoint holds fp8 scaling state: call mp.prepare(model) before mp.load_state_dict")
        return
    if state is not None:
        fp8.load_state_dict(state)


def describe_lines(spec: Any, fp8: "Fp8Training | None") -> list[str]:
    """``MixedPrecision.describe``'s fp8 lines: the spec, then each ``nn.Linear`` once a model is prepared."""
    lines = fp8.describe() if fp8 is not None else [describe_spec(spec) + " (prepare a model to see its layers)"]
    return [("fp8      " if i == 0 else "         ") + ln for i, ln in enumerate(lines)]


class Fp8Training:
    """The fp8 linears of one prepared model and their scaling state."""

    def __init__(self, spec: Any, model: nn.Module, decisions: list[Decision], backend: str) -> None:
        self.spec = spec
        self.model = model
        self.decisions = decisions
        self.backend = backend
        self.layers = fp8_layers(model)
        self._formats = self.layers[0][1].fp8_config.formats if self.layers else ()

    @classmethod
    def attach(cls, model: nn.Module, spec: Any, device: torch.device, recipe: str = "fp8") -> "Fp8Training":
        decisions = swap(model, spec, device)
        state = cls(spec, model, decisions, backend_for(spec, device))
        if not state.layers:
            why = "; ".join(f"{d.name}: {d.reason}" for d in decisions[:6]) or "it has no nn.Linear at all"
            warnings.warn(f"recipe {recipe!r}: no layer of this model computes in fp8 ({why}). It trains as "
                          "bf16-mixed; see mp.describe() for the rules, or pass fp8={'skip_first_last': False, "
                          "'exclude': ()} to widen them.", Fp8Warning, stacklevel=3)
        return state

    @property
    def delayed(self) -> bool:
        return self.spec.scaling == "delayed"

    def after_step(self, skipped: torch.Tensor | None) -> None:
        """The optimizer step is done (or was skipped: ``skipped`` True): advance delayed scaling."""
        if self.delayed and self.layers:
            delayed.update([m.fp8_amax_history for _, m in self.layers], [m.fp8_scale for _, m in self.layers],
                           self._formats, self.spec.amax_compute_algo, self.spec.margin, skipped)

    def scales(self) -> dict[str, torch.Tensor]:
        """Delayed scaling's current scales per layer (input, weight, grad_output); empty otherwise."""
        return {n: m.fp8_scale for n, m in self.layers} if self.delayed else {}

    def state_dict(self) -> dict[str, Any]:
        layers = {n: {"amax_history": m.fp8_amax_history.clone(), "scale": m.fp8_scale.clone()}
                  for n, m in self.layers} if self.delayed else {}
        return {"scaling": self.spec.scaling, "layers": layers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaling") != self.spec.scaling:
            raise ValueError(f"the checkpoint's fp8 state is for {state.get('scaling')!r} scaling, this recipe "
                             f"uses {self.spec.scaling!r}")
        saved = state.get("layers", {})
        ours = dict(self.layers) if self.delayed else {}
        if set(saved) != set(ours):
            raise ValueError(f"the checkpoint's fp8 layers {sorted(saved)} are not this model's {sorted(ours)}: "
                             "prepare the same model with the same fp8 options before loading")
        for name, entry in saved.items():
            m = ours[name]
            if entry["amax_history"].shape != m.fp8_amax_history.shape:
                raise ValueError(f"fp8 layer {name!r}: the checkpoint's amax history has shape "
                                 f"{tuple(entry['amax_history'].shape)}, this recipe's {tuple(m.fp8_amax_history.shape)} "
                                 "(a different amax_history_len)")
            m.fp8_amax_history.copy_(entry["amax_history"])
            m.fp8_scale.copy_(entry["scale"])

    def describe(self) -> list[str]:
        """One line for the recipe, then one per ``nn.Linear``: fp8, or why it stays."""
        n = sum(d.fp8 for d in self.decisions)
        lines = [f"{describe_spec(self.spec, self.backend)}; {n} of {len(self.decisions)} nn.Linear in fp8"]
        width = max((len(d.name) for d in self.decisions), default=0)
        for d in self.decisions:
            shape = f"{d.in_features}->{d.out_features}"
            lines.append(f"  {d.name or '(model)':<{width}}  {shape:>11}  {d.precision}"
                         + ("" if d.fp8 else f"  ({d.reason})"))
        return lines
