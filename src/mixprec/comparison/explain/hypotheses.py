"""The causes the debugging order names, each as evidence plus candidates that change one thing.

- ``fp32_stability``: check 1, always first, from the comparison's fp32 runs (no new run).
- ``scale_candidates``: the loss-scale history and the gradients fp16 flushed; a dynamic scaler,
  a static scale that fits the gradients, an initial scale, a growth interval, or bf16.
- ``loss_candidates``: the dtype the loss was computed in and the reductions that ran in 16 bits;
  an fp32 output (``o=f32``) when the policy hands the loss 16-bit outputs.
- ``masters_candidates``: for 16-bit storage, how much of each update the stored weights kept;
  fp32 masters, or compensated (Kahan) ones.
- ``island_candidate``: the recipe with some modules as fp32 islands (the search in ``search``).
- ``conclude``: a hypothesis's status from its candidates' verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from mixprec.comparison.explain.candidates import Candidate, Outcome
from mixprec.comparison.explain.capture import ROOT, Capture
from mixprec.comparison.explain.result import Finding
from mixprec.comparison.verdict import ema
from mixprec.formats import get_format
from mixprec.instruments.reductions import OUTSIDE
from mixprec.policy import Policy
from mixprec.recipes import Recipe, get_recipe

_16 = (torch.float16, torch.bfloat16)
#: fp32 is unstable when its seeds disagree by this share of how far training moved its loss
UNSTABLE_SPREAD = 0.5


def _pow2(x: float) -> str:
    return f"2^{round(math.log2(x))}" if x > 0 and float(x).is_integer() and math.log2(x).is_integer() else f"{x:g}"


# ---------------------------------------------------------------------------- fp32 itself


def fp32_stability(comparison: Any) -> Finding:
    """Does fp32 itself train the same from every seed? (No run: the comparison's fp32 runs.)"""
    fp32 = [r for r in comparison.runs if r.role in ("reference", "noise")]
    bad = [r for r in fp32 if not np.isfinite(r.loss).all()]
    if bad:
        r = bad[0]
        step = int(np.flatnonzero(~np.isfinite(r.loss))[0]) + 1
        return Finding("fp32", "HOLDS", f"{r.label} has a non-finite loss at step {step}: the model (its learning rate, "
                       "initialisation or data), not the format, is the problem. Fix it in fp32 first.",
                       [f"{r.label}: loss {r.loss[step - 1]} at step {step}"])
    band = comparison.band
    span = band.rule.span
    center = band.center
    moved = float(np.max(center) - np.min(center))
    # the spread where training has settled (the last quarter): at the start the seeds differ by
    # their initial weights, which is what seeds are for, not instability
    tail = band.noise_gap[-max(1, len(band.noise_gap) // 4):]
    spread = float(np.max(tail)) if len(tail) else 0.0
    rising = [r for r in fp32 if _rises(r.loss, span)]
    evidence = [f"over the last quarter of the steps fp32's seeds differ by up to {spread:.3g} (smoothed); training "
                f"moved the reference's loss by {moved:.3g}"]
    if rising:
        evidence.append(f"{', '.join(r.label for r in rising)}: the smoothed loss ends above where it started")
    if rising or (moved > 0 and spread > UNSTABLE_SPREAD * moved):
        return Finding("fp32", "HOLDS", "fp32 does not train the same from one seed to the next (its seeds disagree as "
                       "much as training moves the loss, or the loss rises): the model, not the format, is the problem; "
                       "a verdict against this band says little. Stabilise it in fp32 first (learning rate, warm-up, "
                       "initialisation, clipping).", evidence)
    return Finding("fp32", "REJECTED", f"fp32 is stable across {len(fp32)} seeds (their spread is "
                   f"{spread / moved if moved else 0:.1%} of how far training moved the loss).", evidence)


def _rises(loss: np.ndarray, span: int) -> bool:
    s = ema(loss, span)
    return len(s) > 2 * span and s[-1] > s[min(span, len(s) - 1)] * 1.1 and s[-1] > s[0]


# ---------------------------------------------------------------------------- the loss scale


def scale_candidates(recipe: Recipe, run: Any, capture: Capture, horizon: int) -> tuple[list[str], list[Candidate]]:
    """Evidence about the loss scale and fp16's range (or fp8's scaling), and the candidates that change it."""
    if recipe.fp8 is not None and recipe.fp8.scaling == "none":
        return ([f"fp8 without scaling: {recipe.fp8.format} casts of every tensor at scale 1 (values under fp8's "
                 "smallest subnormal flush to zero)"],
                # the registered scaled recipes, so that the fix names what runs (the baseline with another
                # scaling, pasted, ran current scaling under the name fp8-unscaled)
                [Candidate("scale", f"{name} ({kind} scaling, e5m2 gradients, first and last layers in bf16)",
                           get_recipe(name)) for name, kind in (("fp8-current", "current"), ("fp8-delayed", "delayed"))])
    if recipe.compute_dtype != torch.float16:
        return [], []
    ev, cands = [], []
    scale = np.asarray(run.scale, dtype=np.float64) if run is not None else np.zeros(0)
    skipped = int(np.asarray(run.skipped).sum()) if run is not None else 0
    if recipe.loss_scaling == "none":
        ev.append("no loss scaling: fp16 gradients below 2^-24 flush to zero")
    elif len(scale):
        low = int(np.argmin(scale))
        ev.append(f"loss scale ({recipe.loss_scaling}): {_pow2(scale[0])} at step 1, lowest {_pow2(scale[low])} at step "
                  f"{low + 1}, {_pow2(scale[-1])} at the end; {skipped} of {len(scale)} steps skipped for overflow")
    at = ", ".join(_pow2(s) for s in sorted(set(capture.scales)))
    if capture.flushed is not None:
        ev.append(f"at scale {at}, {capture.flushed:.1%} of the gradient entries non-zero in fp32 were zero in fp16")
    over = [m.label for m in capture.modules if m.grad_overflow]
    if over:
        ev.append(f"at scale {at}, the backward of {len(over)} module(s) overflowed fp16 given fp32's gradient: "
                  + ", ".join(over[:6]) + (" ..." if len(over) > 6 else ""))
    f16 = get_format(torch.float16)
    ev.append(f"fp32's largest gradient was {capture.grad_max:.3g}: scales up to {_pow2(capture.fit_scale)} keep it under "
              f"half of fp16's max ({f16.max:g})")

    def variant(change: str, hyp: str = "scale", options: tuple = (), **fields: Any) -> None:
        try:
            cands.append(Candidate(hyp, change, dataclasses.replace(recipe, **fields) if fields else recipe, options))
        except ValueError:
            pass  # a combination the recipe rules refuse: not a candidate

    fit = capture.fit_scale
    if recipe.loss_scaling in ("none", "static"):
        variant("dynamic loss scaling", loss_scaling="dynamic")
    if recipe.loss_scaling == "static" and fit != recipe.static_scale:
        variant(f"static loss scale {_pow2(fit)} (fits fp32's gradients)", static_scale=fit)
    if recipe.loss_scaling == "dynamic" and len(scale):
        if fit >= 8 * scale[0] or fit * 8 <= scale[0]:
            variant(f"initial scale {_pow2(fit)} ({'larger' if fit > scale[0] else 'smaller'}: fits fp32's gradients)",
                    options=(("scaler", {"init_scale": fit}),))
        if skipped and scale[-1] < scale[0]:
            every = max(10, horizon // 10)
            variant(f"scale grows back every {every} clean steps (growth_interval={every})",
                    options=(("scaler", {"growth_interval": every}),))
    twin = _bf16_twin(recipe)
    if twin is not None:
        cands.append(Candidate("format", "bf16 instead of fp16 (fp32's range, no loss scaling)", twin))
    return ev, cands


def _bf16_twin(recipe: Recipe) -> Recipe | None:
    p = recipe.policy
    store = torch.bfloat16 if p.param_dtype == torch.float16 else p.param_dtype
    out = torch.bfloat16 if p.output_dtype == torch.float16 else p.output_dtype
    try:
        return dataclasses.replace(recipe, name=f"{recipe.name} as bf16", policy=Policy(store, torch.bfloat16, out),
                                   loss_scaling="none")
    except ValueError:
        return None


# ---------------------------------------------------------------------------- the loss, reductions


def loss_candidates(recipe: Recipe, capture: Capture) -> tuple[list[str], list[Candidate], bool]:
    """Evidence about 16-bit losses and reductions; the o=f32 candidate; whether the loss was 16-bit."""
    ev = [f"the model's output reached the loss in {capture.output_dtype}; the loss came out in {capture.loss_dtype}"
          + (", non-finite from finite outputs (fp32's was finite)" if capture.loss_made_nonfinite else
             ", non-finite, as the model's output already was" if math.isinf(capture.loss_error) else
             f", {capture.loss_error:.2g} relative error against fp32's")]
    in_loss = [r for r in capture.reductions if r.module == OUTSIDE]
    in_model = [r for r in capture.reductions if r.module != OUTSIDE]
    if in_loss:
        ev.append("in the loss, on 16-bit inputs: " + ", ".join(f"{r.op} ({r.dtype}, {r.numel} elements)" for r in in_loss))
    if in_model:
        shown = ", ".join(f"{r.module}: {r.op} ({r.dtype}, {r.numel})" for r in in_model[:8])
        ev.append(f"reductions on 16-bit inputs inside the model: {shown}" + (" ..." if len(in_model) > 8 else ""))
    sixteen = capture.loss_dtype in ("bf16", "f16") or bool(in_loss)
    cands = []
    if capture.output_dtype in ("bf16", "f16") and recipe.policy.output_dtype != torch.float32 and recipe.autocast:
        p = recipe.policy
        cands.append(Candidate("loss", "the model's output, and the loss, in fp32 (o=f32)",
                               dataclasses.replace(recipe, name=str(Policy(p.param_dtype, p.compute_dtype, torch.float32)),
                                                   policy=Policy(p.param_dtype, p.compute_dtype, torch.float32))))
    return ev, cands, sixteen


# ---------------------------------------------------------------------------- masters


def masters_candidates(recipe: Recipe, capture: Capture) -> tuple[list[str], list[Candidate]]:
    if not recipe.stores_16bit:
        return [], []
    kept = sorted((m for m in capture.modules if m.kept is not None), key=lambda m: m.kept)
    ev = []
    if kept:
        worst = kept[:4]
        ev.append("share of the optimizer's update the stored weights kept: "
                  + ", ".join(f"{m.label} {max(m.kept, 0):.0%}" for m in worst)
                  + f" (master: {recipe.master})")
    cands = []
    if recipe.master != "fp32":
        cands.append(Candidate("masters", "fp32 master weights", dataclasses.replace(recipe, master="fp32")))
    if recipe.master in ("nearest", "sr") and recipe.policy.param_dtype == torch.bfloat16:
        cands.append(Candidate("masters", "Kahan-compensated bf16 weights", dataclasses.replace(recipe, master="kahan")))
    return ev, cands


# ---------------------------------------------------------------------------- islands


def island_candidate(recipe: Recipe, names: Any, capture: Capture) -> Candidate:
    """The recipe with ``names`` as fp32 islands. (Under 16-bit storage ``MixedPrecision`` keeps an island's
    parameters fp32 by itself; naming them in ``fp32_params`` too refused islands that own no parameter, a
    softmax module or a norm without weights, and the whole-forward candidate ended in an error taken for
    "does not track": found by a probe.)"""
    order = {m.name: m.order for m in capture.modules}
    names = tuple(sorted(names, key=lambda n: order.get(n, 0)))
    options: list[tuple[str, Any]] = [("fp32_modules", names)]
    change = "the whole forward in fp32 (the model as one island)" if names == ("",) else \
        f"fp32 islands {list(n or ROOT for n in names)}"
    return Candidate("islands", change, recipe, tuple(options))


def search_tree(capture: Capture) -> dict[str, list[str]]:
    """The call tree for the island search: each module's children ranked by the error they add,
    leaving out islands the recipe already has and modules whose computation is fp32's bit for
    bit (an island cannot change them)."""
    usable = [m for m in capture.modules if not m.island and not (m.unchanged and m.unmeasured is None)]
    tree: dict[str, list[str]] = {}
    for m in usable:
        if m.parent is None:
            continue
        tree.setdefault(m.parent, []).append(m.name)
    for parent, kids in tree.items():
        kids.sort(key=lambda n: (-_score(capture, n), capture.module(n).order))
    return tree


def _score(capture: Capture, name: str) -> float:
    s = capture.module(name).score
    return s if s == s else -1.0


# ---------------------------------------------------------------------------- conclusions


def conclude(hypothesis: str, evidence: list[str], outcomes: list[Outcome], *, none_why: str) -> Finding:
    """HOLDS when a candidate tracks, REJECTED when none does; ``none_why`` when there was nothing to run."""
    if not outcomes:
        status = "NOT APPLICABLE" if none_why.startswith("not applicable") else "REJECTED"
        return Finding(hypothesis, status, none_why.removeprefix("not applicable: "), evidence)
    good = [o for o in outcomes if o.tracks]
    if good:
        names = "; ".join(o.candidate.change for o in good)
        return Finding(hypothesis, "HOLDS", f"tracks with: {names}", evidence, outcomes)
    tried = "; ".join(f"{o.candidate.change} ({o.verdict.status})" for o in outcomes)
    return Finding(hypothesis, "REJECTED", f"no change of this kind tracks: {tried}", evidence, outcomes)
