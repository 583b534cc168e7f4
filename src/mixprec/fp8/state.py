"""``Fp8Training``: what ``MixedPrecision`` holds for an fp8 recipe, and the three points where it acts.

- ``prepare``: ``Fp8Training.attach`` swaps the eligible layers (``swap``) and keeps the decisions.
  A model with no eligible layer is refused (``Fp8Error``): it would train as bf16-mixed under an
  fp8 name. One whose only fp8 layer is its LM head (what torchao keeps in bf16) gets an
  ``Fp8Warning`` and a ``note`` that reports showing a verdict print (``mixprec compare``).
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

from mixprec.fp8 import delayed, weight_cache
from mixprec.fp8.dist import amax_group, buffer_names, reduce_amax_
from mixprec.fp8.options import check_options, check_scaling
from mixprec.fp8.swap import LM_HEAD, Decision, backend_for, fp8_layers, swap


class Fp8Warning(UserWarning):
    """An fp8 recipe that does something ill-advised (its only fp8 layer is the LM head, for one)."""


class Fp8Error(ValueError):
    """An fp8 recipe that cannot apply to this model: no layer of it would compute in fp8."""


def describe_spec(spec: Any, backend: str | None = None) -> str:
    """One line: formats, scaling and GEMM."""
    fmt = "HYBRID (e4m3 fwd, e5m2 grads)" if spec.format == "hybrid" else "E4M3 (gradients too)"
    if spec.scaling == "delayed":
        how = f"delayed scaling, amax history {spec.amax_history_len} ({spec.amax_compute_algo}), margin {spec.margin}"
    elif spec.granularity == "mx":
        how = "MXFP8 block scaling (a power-of-two e8m0 scale per 32 elements, rounded up: rceil)"
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
        spec = options
    elif not isinstance(options, dict):
        raise TypeError(f"fp8 options are a dict of Fp8Spec fields or an Fp8Spec, got {type(options).__name__}")
    else:
        fields = [f.name for f in dataclasses.fields(Fp8Spec)]
        if set(options) - set(fields):
            raise ValueError(f"unknown fp8 option(s) {sorted(set(options) - set(fields))}; expected some of "
                             f"{', '.join(fields)}")
        spec = dataclasses.replace(recipe.fp8, **options)
        check_options(spec.scaling, options)
    check_scaling(recipe, spec)
    return spec


def load_fp8_state(mp: Any, state: dict[str, Any] | None, saved_recipe: Any = None,
                   steps: int | None = None) -> None:
    """``MixedPrecision.load_state_dict``'s fp8 part: refuses fp8 state that this run cannot take
    (not an fp8 recipe; not prepared yet), saying which."""
    check_fp8_state(mp, state, saved_recipe, steps)
    if mp.fp8 is not None and state is not None:
        mp.fp8.load_state_dict(state)


def check_fp8_state(mp: Any, state: dict[str, Any] | None, saved_recipe: Any = None,
                    steps: int | None = None) -> None:
    """``load_fp8_state``'s refusals, without writing: ``MixedPrecision.load_state_dict`` checks every part
    of a checkpoint before it applies any. ``steps``: the checkpoint's optimizer steps (0: saved before
    any step, so no scaling state to miss; None: not known)."""
    fp8 = mp.fp8
    if state is not None and not isinstance(state, dict):
        raise ValueError(f"the checkpoint's fp8 state must be the dict mp.state_dict()['fp8'] holds, got "
                         f"{type(state).__name__}: the checkpoint is damaged or was edited")
    if fp8 is None:
        if not (state and state.get("layers")):
            return
        if mp.fp8_spec is None:
            raise ValueError(f"the checkpoint holds fp8 scaling state ({state.get('scaling')!r} scaling, "
                             f"{len(state['layers'])} fp8 layers, recipe {saved_recipe!r}); this run's recipe "
                             f"{mp.recipe.name!r} has no fp8 layers, so it cannot take it. Resume with the checkpoint's "
                             "recipe, or leave the fp8 part out: mp.load_state_dict({k: v for k, v in state.items() "
                             "if k != 'fp8'}, strict=False)")
        raise RuntimeError("the checkpoint holds fp8 scaling state: call mp.prepare(model) before mp.load_state_dict")
    if state is not None:
        fp8.check_state_dict(state)
    elif fp8.delayed and fp8.layers and saved_recipe == mp.recipe.name and steps != 0:
        raise ValueError(f"the checkpoint is of recipe {saved_recipe!r} but holds no fp8 scaling state (a prepared "
                         f"run's mp.state_dict() saves it as 'fp8'): the {len(fp8.layers)} fp8 layers "
                         "would resume from scale 1 and an empty amax history, another run than the one saved. Load "
                         "the whole mp.state_dict() that was saved; to start the scaling afresh on purpose, give this "
                         "run's own: mp.load_state_dict({**state, 'fp8': mp.state_dict()['fp8']})")


def check_layer_state(name: str, entry: Any, m: Any) -> None:
    """One delayed-scaling layer's saved state: its shapes, and scales that are finite and positive
    (a scale of 0 or inf would silently zero or saturate every cast)."""
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), torch.Tensor) for k in ("amax_history", "scale")):
        raise ValueError(f"fp8 layer {name!r}: the checkpoint's entry must hold the tensors 'amax_history' and 'scale'")
    h, s = entry["amax_history"], entry["scale"]
    if h.shape != m.fp8_amax_history.shape:
        raise ValueError(f"fp8 layer {name!r}: the checkpoint's amax history has shape {tuple(h.shape)}, this "
                         f"recipe's {tuple(m.fp8_amax_history.shape)} (a different amax_history_len)")
    if not h.is_floating_point() or bool((h.detach() < 0).any()):
        raise ValueError(f"fp8 layer {name!r}: the checkpoint's amax history ({h.dtype}) must hold floats >= 0 "
                         "(each a tensor's max |x|); the checkpoint is damaged or was edited")
    if s.shape != m.fp8_scale.shape or not s.is_floating_point():
        raise ValueError(f"fp8 layer {name!r}: the checkpoint's scale is {s.dtype} {tuple(s.shape)}, expected "
                         f"{tuple(m.fp8_scale.shape)} floats (input, weight, grad_output)")
    # judged as the layer will hold it: a float64 scale of 1e300 is finite, and inf once copied into fp32
    saved, s = s.dtype, s.detach().to(m.fp8_scale.dtype)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        held = "" if saved == s.dtype else f" (as the layer's {s.dtype} holds it; saved as {saved})"
        raise ValueError(f"fp8 layer {name!r}: the checkpoint's scale {s.tolist()}{held} is not finite and positive "
                         "everywhere (a scale of 0 or inf zeroes or saturates every cast); the checkpoint is damaged")


def describe_lines(spec: Any, fp8: "Fp8Training | None") -> list[str]:
    """``MixedPrecision.describe``'s fp8 lines: the spec, then each ``nn.Linear`` once a model is prepared."""
    lines = fp8.describe() if fp8 is not None else [describe_spec(spec) + " (prepare a model to see its layers)"]
    return [("fp8      " if i == 0 else "         ") + ln for i, ln in enumerate(lines)]


def _widen(decisions: list[Decision], spec: Any) -> str:
    """The options that would put some layer in fp8 (none, when the layers' shapes rule them all out)."""
    ways = []
    if spec.exclude and any(d.reason.startswith("excluded by") for d in decisions):
        ways.append("fp8={'exclude': ()}")
    if spec.skip_first_last and any(d.reason == LM_HEAD or d.reason.startswith(("the first", "the last"))
                                    for d in decisions):
        ways.append("fp8={'skip_first_last': False} (which puts the first and last layers in fp8)")
    return f" To widen the rules, pass {' or '.join(ways)}." if ways else ""


class Fp8Training:
    """The fp8 linears of one prepared model and their scaling state."""

    def __init__(self, spec: Any, model: nn.Module, decisions: list[Decision], backend: str) -> None:
        self.spec = spec
        self.model = model
        self.decisions = decisions
        self.backend = backend
        self.layers = fp8_layers(model)
        self.note: str | None = None  # a loud line for every report that shows this run's verdict
        self._formats = self.layers[0][1].fp8_config.formats if self.layers else ()

    @classmethod
    def attach(cls, model: nn.Module, spec: Any, device: torch.device, recipe: str = "fp8") -> "Fp8Training":
        decisions = swap(model, spec, device)
        state = cls(spec, model, decisions, backend_for(spec, device))
        if not state.layers:
            why = "; ".join(f"{d.name or '(model)'}: {d.reason}" for d in decisions[:6]) or "it has no nn.Linear or Conv1D at all"
            why += f"; and {len(decisions) - 6} more" if len(decisions) > 6 else ""
            widen = _widen(decisions, spec)
            raise Fp8Error(f"recipe {recipe!r}: no layer of this model would compute in fp8 ({why}), so it would train "
                           f"as bf16-mixed under the name {recipe!r}. Train it as bf16-mixed, or see mp.describe() for "
                           f"the rules.{widen}")
        state.note = state._ill_advised(recipe)
        if state.note:
            warnings.warn(state.note, Fp8Warning, stacklevel=3)
        return state

    def _ill_advised(self, recipe: str) -> str | None:
        """The loud line for a run whose only fp8 layers are what torchao keeps in bf16 (the LM head)."""
        fp8 = [d for d in self.decisions if d.fp8]
        if not all(d.lm_head for d in fp8):
            return None
        return (f"recipe {recipe!r}: the only layer in fp8 is the LM head {fp8[0].name!r} (torchao keeps it in bf16: "
                "it is the most sensitive matmul), every other matmul runs bf16-mixed; this is not an fp8 run of "
                "the model. Keep skip_first_last=True and make the model's other layers eligible (see mp.describe()).")

    @property
    def delayed(self) -> bool:
        return self.spec.scaling == "delayed"

    def after_step(self, skipped: torch.Tensor | None, parallel: Any = None) -> None:
        """The optimizer step is done (or was skipped: ``skipped`` True): advance delayed scaling, the
        current amaxes first reduced over the data-parallel ranks (``mixprec.fp8.dist``)."""
        for _, m in self.layers:  # the weights change now: the cached fp8 casts go (``weight_cache``)
            weight_cache.clear(m)
        if self.delayed and self.layers:
            histories = [m.fp8_amax_history for _, m in self.layers]
            if self.spec.reduce_amax:
                ranks, group = amax_group(parallel)
                if ranks:
                    reduce_amax_(histories, group)
            delayed.update(histories, [m.fp8_scale for _, m in self.layers], self._formats,
                           self.spec.amax_compute_algo, self.spec.margin, skipped)

    def enable_fp8_all_gather(self) -> None:
        """``FSDP(fp8_all_gather=True)``: the fp8 layers' weights all-gather as fp8 (``mixprec.fp8.fsdp``)."""
        from mixprec.fp8 import fsdp

        fsdp.enable(self.layers)

    def buffer_names(self) -> list[str]:
        """The scaling buffers' qualified names in the model (kept out of DDP's broadcast)."""
        return buffer_names(self.model)

    def scales(self) -> dict[str, torch.Tensor]:
        """Delayed scaling's current scales per layer (input, weight, grad_output); empty otherwise."""
        return {n: m.fp8_scale for n, m in self.layers} if self.delayed else {}

    def state_dict(self) -> dict[str, Any]:
        layers = {n: {"amax_history": m.fp8_amax_history.clone(), "scale": m.fp8_scale.clone()}
                  for n, m in self.layers} if self.delayed else {}
        return {"scaling": self.spec.scaling, "layers": layers}

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError when ``state`` cannot be loaded; writes nothing (``load_state_dict`` runs it first)."""
        if not isinstance(state, dict) or not isinstance(state.get("layers", {}), dict):
            raise ValueError(f"the checkpoint's fp8 state must be the dict mp.state_dict()['fp8'] holds ({{'scaling', "
                             f"'layers'}}), got {type(state).__name__}: the checkpoint is damaged or was edited")
        if state.get("scaling") != self.spec.scaling:
            raise ValueError(f"the checkpoint's fp8 state is for {state.get('scaling')!r} scaling, this recipe "
                             f"uses {self.spec.scaling!r}")
        saved = state.get("layers", {})
        ours = dict(self.layers) if self.delayed else {}
        if set(saved) != set(ours):
            raise ValueError(f"the checkpoint's fp8 layers {sorted(saved)} are not this model's {sorted(ours)}: "
                             "prepare the same model with the same fp8 options before loading")
        for name, entry in saved.items():
            check_layer_state(name, entry, ours[name])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output; everything is checked before any layer's state changes."""
        self.check_state_dict(state)
        ours = dict(self.layers) if self.delayed else {}
        for name, entry in state.get("layers", {}).items():
            ours[name].fp8_amax_history.copy_(entry["amax_history"])
            ours[name].fp8_scale.copy_(entry["scale"])

    def describe(self) -> list[str]:
        """One line for the recipe, then one per ``nn.Linear`` or ``Conv1D``: fp8, or why it stays."""
        n = sum(d.fp8 for d in self.decisions)
        kinds = " and ".join(k for k, kind in (("nn.Linear", "Linear"), ("Conv1D", "Conv1D"))
                             if any(d.kind == kind for d in self.decisions))
        lines = [f"{describe_spec(self.spec, self.backend)}; {n} of {len(self.decisions)} {kinds or 'nn.Linear'} in fp8"]
        width = max((len(d.name) for d in self.decisions), default=0)
        for d in self.decisions:
            shape = f"{d.in_features}->{d.out_features}"
            lines.append(f"  {d.name or '(model)':<{width}}  {shape:>11}  {d.precision}"
                         + ("" if d.kind == "Linear" else f"  {d.kind}") + ("" if d.fp8 else f"  ({d.reason})"))
        if self.note:
            lines.append(f"  WARNING: {self.note}")
        return lines
