"""The checklist ``doctor`` runs, in the seeds' order, then the probes. Each check reads the
``Evidence`` gathered by the runs and returns one ``Finding``.

Seeds' order: (1) the same step in fp32, (2) the loss in fp32, (3) unscale before clipping,
(4) log(0) / division by zero / sqrt of a negative, (5) a normalisation in 16 bits with tiny
variance, (6) does bf16 remove it. Before them, the symptom (the step under the recipe); after
them, the probes: activation range, gradient underflow, update vanishing, the loss scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mixprec.diagnostics.causes import explain
from mixprec.diagnostics.doctor_runs import RunResult
from mixprec.diagnostics.findings import Finding
from mixprec.diagnostics.events import NonFiniteEvent
from mixprec.diagnostics.probes._common import pow2_label
from mixprec.diagnostics.probes.activations import ActivationRangeReport
from mixprec.diagnostics.probes.gradients import GradUnderflowReport
from mixprec.diagnostics.probes.fp8 import ALARM_DB, WARN_DB, worst
from mixprec.diagnostics.probes.updates import UpdateVanishingReport
from mixprec.fp8 import CastStats
from mixprec.formats import get_format, is_floating_16bit, short_name
from mixprec.recipes import Recipe

MATH_DOMAIN = ("log-of-zero", "log-of-negative", "division-by-zero", "sqrt-of-negative", "sqrt-of-zero")
# A module's gradient is damaged when the values that flush to zero carry this share of its squared
# norm; many flushed values carrying almost none of it (a saturated softmax's) are harmless.
UNDERFLOW_NORM, UNDERFLOW_VALUES = 0.01, 0.10
# An fp8 cast that flushes this share of a tensor's nonzero values loses that population, whatever
# its SQNR says (a few large values carry the norm; an unscaled e4m3 gradient keeps 20 dB while most
# of its values become 0): an alarm at ``FP8_FLUSH_ALARM``, a warning at ``FP8_FLUSH_WARN``.
FP8_FLUSH_ALARM, FP8_FLUSH_WARN = 0.10, 0.01


@dataclasses.dataclass
class NormStat:
    """A normalisation-like module: its smallest input row variance in fp32, and whether the recipe
    runs it in 16 bits."""

    name: str
    type: str
    min_var: float
    sixteen_bit: bool


@dataclasses.dataclass
class Evidence:
    recipe: Recipe
    run: RunResult
    fp32: RunResult
    bf16: RunResult | None = None
    grads: GradUnderflowReport | None = None
    updates: UpdateVanishingReport | None = None
    activations: ActivationRangeReport | None = None
    norms: list[NormStat] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    kept_fp32: frozenset[str] = frozenset()  # parameters a 16-bit storage recipe keeps in fp32 (its rule)
    fp8: list[CastStats] | None = None  # an fp8 recipe's casts (probes.fp8)
    fp8_step: int = 0  # ... probed after this many training steps

    @property
    def compute_fmt(self) -> str:
        return short_name(self.recipe.policy.compute_dtype)


def _event_finding(check: str, title: str, status: str, summary: str, ev: NonFiniteEvent, extra: tuple[str, ...] = ()) -> Finding:
    c = explain(ev)
    evidence = (ev.describe().splitlines()[0], *(ln.strip() for ln in ev.describe().splitlines()[1:4]), *extra)
    return Finding(check, title, status, summary, evidence, c.fix, ev.module, ev.op, c.code, ev.where)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def _losses(run: RunResult) -> str:
    return ", ".join(f"{v:.4g}" for v in run.losses) or "none"


def check_recipe_step(ev: Evidence) -> Finding:
    title = f"Does a step under {ev.run.recipe} stay finite?"
    run = ev.run
    if run.error is not None:
        return Finding("recipe-step", title, "alarm", f"the step under {run.recipe} failed: {run.error}",
                       fix="fix the error first; the rest of the checklist assumes a step runs")
    fault = run.first_fault
    if fault is not None:
        c = explain(fault)
        summary = f"{fault.kind.upper()} in the {fault.phase} under {run.recipe}: {fault.where_text} ({c.code})"
        return _event_finding("recipe-step", title, "alarm", summary, fault, (f"losses: {_losses(run)}",))
    if not run.finite:
        return Finding("recipe-step", title, "alarm", f"non-finite loss under {run.recipe} ({_losses(run)}), "
                       "produced outside what the guard watched", fix="compute the loss inside the model or the guarded block")
    scaled = [e for e in run.events if e.scaled]
    if scaled:
        evidence = tuple(e.describe().splitlines()[0] for e in scaled[:3])
        d = run.diagnosis
        if d is not None and not d.healthy:  # the loss-scale finding says why; this one must not call it normal
            return Finding("recipe-step", title, "warn",
                           f"losses finite ({_losses(run)}), but {len(scaled)} backward overflow(s) at the loss scale "
                           "were skipped and the scale did not recover: see the loss-scale finding", evidence)
        lead = next((i for i, skip in enumerate(run.skipped) if not skip), len(run.skipped))
        warm = (f"; the first {lead} step(s) were skipped while the scale came down from {pow2_label(run.scale)} "
                f"to {pow2_label(run.train_scale)}, where it trains (the scaler's warm-up)"
                if 0 < lead < len(run.skipped) else "")
        return Finding("recipe-step", title, "ok",
                       f"losses finite ({_losses(run)}); {len(scaled)} backward overflow(s) at the loss scale were "
                       f"skipped by the scaler (normal probing){warm}", evidence)
    return Finding("recipe-step", title, "ok", f"losses finite: {_losses(run)}; no NaN/Inf anywhere in forward or backward")


def check_fp32(ev: Evidence) -> Finding:
    title = "1. Is the fault there in fp32 too?"
    f32 = ev.fp32
    fault = f32.first_fault  # the cause: after a forward NaN, backward events are its consequences
    if fault is not None or not f32.finite:
        if fault is None:
            return Finding("fp32", title, "alarm", f"the fp32 step fails too ({f32.error or _losses(f32)}): "
                           "not a precision problem", fix="debug the model in fp32 first")
        return _event_finding("fp32", title, "alarm",
                              f"yes: fp32 has it too ({fault.where_text}); this is not a precision problem", fault)
    if ev.run.faulty:
        return Finding("fp32", title, "info", f"no: fp32 is clean (losses {_losses(f32)}); the fault comes from 16-bit precision")
    return Finding("fp32", title, "ok", f"fp32 step clean (losses {_losses(f32)})")


def check_loss_fp32(ev: Evidence) -> Finding:
    title = "2. Is the loss computed in fp32?"
    run = ev.run
    inner = [(n, t, d) for n, t, d in run.scalar_modules if d in (_f16(), _bf16())]
    if inner:
        name, typ, dtype = inner[0]  # innermost first: hooks fire as modules finish
        return Finding("loss-fp32", title, "alarm",
                       f"no: the model computes its loss in {short_name(dtype)} inside module {name or '(model)'} ({typ})",
                       (f"module {name or '(model)'} returned a {short_name(dtype)} scalar under {run.recipe}",),
                       f"compute the loss in fp32: MixedPrecision(..., fp32_modules=[{typ!r}]), or return the outputs "
                       "and compute the loss outside the model", module=name, cause="loss-in-16-bit")
    if run.loss_dtype is not None and run.loss_dtype in (_f16(), _bf16()):
        return Finding("loss-fp32", title, "alarm", f"no: the loss function returned {short_name(run.loss_dtype)}",
                       fix="compute the loss on fp32 outputs (prepare() casts them) or outside mp.autocast()",
                       cause="loss-in-16-bit")
    got = "?" if run.loss_dtype is None else short_name(run.loss_dtype)
    return Finding("loss-fp32", title, "ok",
                   f"yes: the loss reached the step in {got}",
                   ("prepare() casts the model's outputs to the policy's output dtype "
                    f"({short_name(ev.recipe.policy.output_dtype)}), so the loss function sees fp32",
                    "MixedPrecision.step warns when a loss arrives in 16 bits"))


def check_unscale_clip(ev: Evidence) -> Finding:
    title = "3. Are gradients unscaled before clipping?"
    run, f32 = ev.run, ev.fp32
    why = "MixedPrecision.step fixes the order: scale -> backward -> unscale -> clip -> step; a task cannot reorder it"
    lint = "for your own training scripts, 'mixprec lint' checks the order in the source"
    # the same step in both (fp32 ran step 0 only): when the scaler skipped step 0, nothing to compare
    g = (run.grad_norms or [None])[0] if not (run.skipped and run.skipped[0]) else None
    g32 = (f32.grad_norms or [None])[0]
    if g is None or g32 is None or not (math.isfinite(g) and math.isfinite(g32)) or g32 == 0:
        return Finding("unscale-clip", title, "ok", "yes, by construction", (why, lint))
    ratio = g / g32
    evidence = (why, f"gradient norm seen by clipping: {g:.4g} under {run.recipe} (loss scale {pow2_label(run.scale)}) "
                f"vs {g32:.4g} in fp32: ratio {ratio:.3g}", lint)
    if 0.5 < ratio < 2.0:
        return Finding("unscale-clip", title, "ok", "yes: clipping saw unscaled gradients (norm matches fp32)", evidence)
    return Finding("unscale-clip", title, "warn",
                   f"clipping saw a gradient norm {ratio:.3g}x fp32's: the 16-bit gradients differ from fp32's",
                   evidence, "look at the gradient-underflow finding below", cause="grad-norm-mismatch")


def check_math_domain(ev: Evidence) -> Finding:
    title = "4. A log(0), a division by zero, or a sqrt of a negative?"
    for run in (ev.run, ev.fp32):
        for e in run.root_faults:  # not the backward of a NaN the forward made (its log_softmax, its sqrt)
            if e.origin == "producer" and explain(e).code in MATH_DOMAIN:
                where = "fp32 too" if run is ev.fp32 else run.recipe
                return _event_finding("math-domain", title, "alarm",
                                      f"yes ({where}): {explain(e).text} in {e.where_text}", e)
    first = ev.run.first_fault or ev.fp32.first_fault
    if first is not None:  # the producer named above is not one of these: say so, and nothing else
        return Finding("math-domain", title, "ok",
                       f"no: the first fault ({first.where_text}, {explain(first).code}) is not a log, a division or a "
                       "sqrt, and what follows it is its consequence")
    return Finding("math-domain", title, "ok", "none: no op produced NaN/Inf from a log, a division or a sqrt")


def check_norm_variance(ev: Evidence) -> Finding:
    title = "5. A normalisation in 16 bits with tiny variance?"
    fmt = get_format(ev.recipe.policy.compute_dtype)
    if fmt.bits >= 32:
        return Finding("norm-variance", title, "ok", "no 16-bit compute in this recipe")
    risky = [n for n in ev.norms if n.sixteen_bit]
    if not risky:
        names = ", ".join(f"{n.name} ({n.type})" for n in ev.norms[:6]) or "none found"
        return Finding("norm-variance", title, "ok", f"no: normalisations run in fp32 ({names})")
    faulted = {e.module for e in ev.run.faults if e.module is not None}
    worst = min(risky, key=lambda n: n.min_var)
    evidence = tuple(f"{n.name} ({n.type}) runs in {fmt.name}: smallest row variance {n.min_var:.3g} in fp32 "
                     f"({fmt.name} smallest normal {fmt.tiny:.3g}, smallest subnormal {fmt.smallest_subnormal:.3g})" for n in risky)
    fix = (f"compute normalisation statistics in fp32: MixedPrecision(..., fp32_modules=[{worst.type!r}]), or use "
           "mixprec.Fp32LayerNorm / Fp32RMSNorm")
    hit = [n for n in risky if n.name in faulted or any(m.startswith(n.name + ".") for m in faulted)]
    if hit:
        n = hit[0]
        return Finding("norm-variance", title, "alarm",
                       f"yes: {n.name} ({n.type}) normalises in {fmt.name} and its variance ({n.min_var:.3g} in fp32) "
                       f"underflows there; the fault above comes from it", evidence, fix, n.name, cause="tiny-variance")
    if worst.min_var < fmt.tiny:
        return Finding("norm-variance", title, "warn",
                       f"{worst.name} ({worst.type}) normalises in {fmt.name} with variances down to {worst.min_var:.3g}, "
                       f"below {fmt.name}'s normal range", evidence, fix, worst.name, cause="tiny-variance")
    return Finding("norm-variance", title, "ok",
                   f"16-bit normalisations ({', '.join(n.name for n in risky)}) have variances well inside {fmt.name}'s range",
                   evidence)


def check_bf16(ev: Evidence) -> Finding:
    title = "6. Does bf16 remove the problem?"
    if not ev.run.faulty:
        return Finding("bf16", title, "ok", "nothing to remove: the step under the recipe is clean")
    if ev.fp32.faulty:
        return Finding("bf16", title, "info", "no: fp32 has the fault too, bf16 cannot remove it")
    if ev.recipe.policy.compute_dtype == _bf16():
        return Finding("bf16", title, "info", "the recipe already computes in bf16; try fp32 islands for the module named above")
    if ev.bf16 is None:
        return Finding("bf16", title, "skipped", "not run: " + ev.errors.get("bf16", "no bf16 run"))
    b = ev.bf16
    if not b.faulty:
        return Finding("bf16", title, "info",
                       f"yes: under bf16-mixed the same step is clean (losses {_losses(b)}): bf16 has fp32's range",
                       fix="use bf16-mixed where the hardware has it (NVIDIA Ampere and later, recent CPUs); else the fix above")
    fault = b.first_fault
    if fault is None:
        return Finding("bf16", title, "alarm", f"no: bf16-mixed fails too ({b.error or _losses(b)})")
    return _event_finding("bf16", title, "alarm", f"no: bf16-mixed has a fault too ({fault.where_text})", fault)


def check_activation_range(ev: Evidence) -> Finding:
    title = "Which activations run out of 16-bit range?"
    if ev.activations is None:
        return Finding("activation-range", title, "skipped", ev.errors.get("activations", "not measured"))
    rep = ev.activations
    if not rep.entries:
        if is_floating_16bit(ev.recipe.policy.compute_dtype):  # a 16-bit recipe that ran nothing in 16 bits
            return Finding("activation-range", title, "warn",
                           f"nothing of this model ran in {ev.compute_fmt} under {ev.recipe.name} (no module computed "
                           "in 16 bits: the forward turned autocast off, cast its inputs back to fp32, or every "
                           "module is kept in fp32), so these checks judged fp32 arithmetic, not the recipe's",
                           fix="let the forward run under mp.autocast(): remove autocast(enabled=False) and .float() "
                               "casts from the model's forward, or name fewer fp32 islands", cause="no-16-bit-compute")
        return Finding("activation-range", title, "ok", "nothing runs in 16 bits under this recipe")
    flagged = rep.flagged()
    evidence = tuple(f"{e.label}: largest |x| {e.absmax:.4g} in fp32 ({e.headroom_bits:+.1f} bits of headroom below "
                     f"{rep.fmt} max {get_format(rep.fmt).max:g})" + (f" at {e.where}" if e.where else "") for e in flagged[:8])
    if not flagged:
        top = min(rep.entries, key=lambda e: e.headroom_bits)
        return Finding("activation-range", title, "ok",
                       f"all 16-bit activations keep at least {rep.headroom_bits:g} bits of headroom (largest: {top.label}, "
                       f"{top.absmax:.4g})")
    e = flagged[0]
    fix = (f"bf16 has fp32's range; or scale before the op, or run {e.module or 'the module'} in fp32 "
           f"(MixedPrecision(..., fp32_modules=[{e.module_type!r}]))")
    if e.status == "overflow":
        return Finding("activation-range", title, "alarm",
                       f"{e.label} reaches {e.absmax:.4g}, past {rep.fmt}'s maximum {get_format(rep.fmt).max:g}: it overflows",
                       evidence, fix, e.module, e.op, "activation-overflow", e.where)
    return Finding("activation-range", title, "warn",
                   f"{e.label} reaches {e.absmax:.4g}: less than {rep.headroom_bits:g} bits below {rep.fmt}'s maximum",
                   evidence, fix, e.module, e.op, "low-headroom", e.where)


def check_grad_underflow(ev: Evidence) -> Finding:
    title = "Which gradients flush to zero in 16 bits?"
    rep = ev.grads
    if rep is None:
        return Finding("grad-underflow", title, "skipped", ev.errors.get("grads", "not measured"))
    fmt = ev.compute_fmt
    if fmt not in ("f16", "bf16"):
        return Finding("grad-underflow", title, "ok", f"gradients are computed in {fmt}")
    scale, rec = ev.run.train_scale, rep.recommended_scale  # the scale it trains at, after the warm-up
    # parameters merged per module, and module output (activation) gradients: the worst of both
    pool = [(s, s.landing(fmt, scale)) for s in (*rep.by_module(), *rep.activations) if s.nonzero]
    if not pool:
        return Finding("grad-underflow", title, "ok", "no nonzero gradients to measure")
    worst, land = max(pool, key=lambda t: (t[1].zero_norm, t[1].zero))
    over = rep.overall
    evidence = [
        f"all gradients: {100 * over.landing(fmt, 1.0).zero:.2f}% of values flush to zero in {fmt} without scaling, "
        f"{100 * over.landing(fmt, scale).zero:.2f}% at the run's loss scale {pow2_label(scale)}"
        + (f", {100 * over.landing(fmt, rec).zero:.2f}% at the recommended {pow2_label(rec)}" if rec else ""),
    ]
    for s, ln in sorted(pool, key=lambda t: (-t[1].zero_norm, -t[1].zero))[:5]:
        what = "parameters" if s.kind == "module" else "output gradient"
        evidence.append(f"{s.name} {what}: {_pct(ln.zero)} of values to zero ({_pct(ln.zero_norm)} of the "
                        f"gradient norm^2), {100 * ln.subnormal:.1f}% subnormal at {pow2_label(scale)}; "
                        f"|g| in [{s.absmin:.2g}, {s.absmax:.2g}]")
    measured = {n: z for n, z in ev.run.zero_grads.items() if n.rpartition(".")[0] == worst.name}
    if measured:
        evidence.append(f"measured in the {ev.run.recipe} step: {100 * max(measured.values()):.1f}% of "
                        f"{worst.name}'s parameter gradients were exactly 0")
    if over.landing(fmt, scale).overflow > 0:
        evidence.append(f"{100 * over.landing(fmt, scale).overflow:.3f}% overflow at {pow2_label(scale)}: "
                        "the dynamic scaler backs off from that (normal)")
    at_rec = worst.landing(fmt, rec) if rec else None
    if rec and at_rec is not None and at_rec.zero_norm < UNDERFLOW_NORM:
        fix = (f"start the loss scale at {pow2_label(rec)}: MixedPrecision({ev.recipe.name!r}, scaler={{'init_scale': "
               f"2.0**{int(math.log2(rec))}}}); or use bf16, whose range needs no scaling")
        helps = f"; a scale of {pow2_label(rec)} keeps them"
    else:
        fix = "no single scale covers these gradients in fp16 (they span more than its range): use bf16"
        helps = ""
    name = worst.name
    if fmt == "f16" and land.zero_norm >= UNDERFLOW_NORM:
        return Finding("grad-underflow", title, "alarm",
                       f"{name}'s gradients flush to zero in {fmt} at the run's loss scale {pow2_label(scale)}: "
                       f"{_pct(land.zero)} of values, {_pct(land.zero_norm)} of the gradient norm^2{helps}",
                       tuple(evidence), fix, name, cause="gradient-underflow")
    if fmt == "f16" and land.zero >= UNDERFLOW_VALUES:
        return Finding("grad-underflow", title, "info",
                       f"{100 * land.zero:.1f}% of {name}'s gradient values flush to zero at {pow2_label(scale)}, but they "
                       f"carry only {_pct(land.zero_norm)} of its gradient norm^2: harmless", tuple(evidence))
    return Finding("grad-underflow", title, "ok",
                   f"at the run's loss scale {pow2_label(scale)} no module loses a meaningful part of its gradient "
                   f"(worst: {name}, {100 * land.zero:.2f}% of values)"
                   + (f"; recommended initial scale {pow2_label(rec)}" if rec and fmt == "f16" else ""), tuple(evidence))


def _decay_note(p: Any) -> str:
    return (f"; {100 * p.decay_only:.0f}% of its updates are weight decay alone, on elements with no gradient "
            "this step (rows of tokens not in the batch)" if p.decay_only >= 0.5 else "")


def check_update_vanishing(ev: Evidence) -> Finding:
    title = "Which updates would vanish without fp32 master weights?"
    rep = ev.updates
    if rep is None:
        return Finding("update-vanishing", title, "skipped", ev.errors.get("updates", "not measured"))
    stored = ev.recipe.policy.param_dtype
    evidence = tuple(f"{p.name}: {100 * p.vanished['bf16']:.1f}% of updates lost in bf16, {100 * p.vanished['f16']:.1f}% in f16 "
                     f"(median |dw/w| {p.relative_update:.2g}){_decay_note(p)}" for p in rep.worst("bf16", 6) if p.updated)
    need = rep.needs_master("bf16")
    if stored in (_f16(), _bf16()):
        fmt = short_name(stored)
        # what this recipe stores in 16 bits: its fp32 rule keeps the others (norms, biases...) in fp32
        at_risk = [p for p in rep.worst(fmt, len(rep.params))
                   if p.name in set(rep.needs_master(fmt)) and p.name not in ev.kept_fp32]
        if at_risk and ev.recipe.master == "nearest":  # 16-bit weights and nothing to keep the updates
            worst = at_risk[0]
            return Finding("update-vanishing", title, "alarm",
                           f"{len(at_risk)} parameter(s) lose over {100 * rep.threshold:.0f}% of their updates in "
                           f"{fmt} storage (worst: {worst.name}, {100 * worst.vanished[get_format(fmt).name]:.1f}%"
                           f"{_decay_note(worst)})", evidence,
                           "keep fp32 master weights (bf16-true / fp16-true, or a p=f32 recipe), or use compensated "
                           "updates (bf16-true-kahan, bf16-true-sr)", worst.name, cause="update-vanishing")
        if at_risk:
            how = {"fp32": "fp32 master weights", "remainder": "exact fp32 masters (bf16 + int16 remainders)",
                   "kahan": "Kahan compensation", "sr": "stochastic rounding"}.get(ev.recipe.master, "its masters")
            return Finding("update-vanishing", title, "info",
                           f"{len(at_risk)} parameter(s) would lose over {100 * rep.threshold:.0f}% of their updates "
                           f"stored in {fmt} alone ({', '.join(p.name for p in at_risk[:4])}"
                           f"{'...' if len(at_risk) > 4 else ''}); {ev.recipe.name} keeps them with {how}, so the "
                           "updates are not lost", evidence)
        kept = [n for n in need if n in ev.kept_fp32]
        return Finding("update-vanishing", title, "ok",
                       f"no parameter this recipe stores in {fmt} loses its updates"
                       + (f" ({len(kept)} that would are stored in fp32 by its rule: {', '.join(kept[:4])})" if kept else ""),
                       evidence)
    summary = (f"{len(need)} parameter(s) would lose over {100 * rep.threshold:.0f}% of their updates if stored in bf16 "
               f"({', '.join(need[:4])}{'...' if len(need) > 4 else ''}); this recipe keeps fp32 weights, so none are lost"
               if need else f"one step's updates survive 16-bit storage ({100 * rep.overall('bf16'):.2f}% lost in bf16)")
    return Finding("update-vanishing", title, "info" if need else "ok", summary, evidence)


def check_loss_scale(ev: Evidence) -> Finding:
    title = "Is the loss scale healthy?"
    run = ev.run
    if run.diagnosis is None:
        return Finding("loss-scale", title, "ok", f"{run.recipe} uses no loss scaling")
    d = run.diagnosis
    fwd = [e for e in run.faults if e.phase == "forward"]
    if fwd and not d.healthy:
        return Finding("loss-scale", title, "info",
                       f"{d.skipped} of {d.steps} steps skipped because the loss itself was non-finite (the first "
                       "finding): a consequence, not a scaler fault")
    evidence = [f"scales used: {', '.join(pow2_label(s) for s in (run.history or {}).get('scale', [])[:12])}"]
    for o in run.overflows[:5]:
        evidence.append(f"step {o.step} overflowed at {pow2_label(o.scale)}: non-finite gradients in "
                        f"{len(o.params)} parameter(s), nearest the loss: {o.nearest_loss}")
    if not d.healthy:
        culprit = run.overflows[-1].nearest_loss if run.overflows else None
        return Finding("loss-scale", title, "alarm", d.message, tuple(evidence),
                       "find the producer: the NaN guard (nan_guard) or the fp32 check above", culprit,
                       cause="scale-collapse")
    return Finding("loss-scale", title, "ok", f"{d.verdict}: {d.message}", tuple(evidence))


def check_fp8_casts(ev: Evidence) -> Finding:
    title = "Which fp8 casts lose their tensor?"
    if ev.recipe.fp8 is None:
        return Finding("fp8-casts", title, "ok", "this recipe computes nothing in fp8")
    if ev.fp8 is None:
        return Finding("fp8-casts", title, "skipped", ev.errors.get("fp8", "not measured"))
    if not ev.fp8:
        return Finding("fp8-casts", title, "warn", "no layer of this model computes in fp8: it trains as bf16-mixed",
                       fix="see MixedPrecision(...).describe() after prepare for the rules that kept each layer")
    flushed = sorted(ev.fp8, key=lambda c: -c.zero)
    bad = worst(ev.fp8, 6)
    when = f"probed after {ev.fp8_step} training step(s)" if ev.fp8_step else "probed at step 0 (no trained state)"
    evidence = (when, *(c.describe() for c in bad),
                *(c.describe() for c in flushed[:3] if c.zero >= FP8_FLUSH_WARN and c not in bad))
    w, f = bad[0], flushed[0]

    def fix(layer: str) -> str:
        return (f"use current scaling (fp8-current) with e5m2 gradients (format 'hybrid'), or keep {layer} in bf16: "
                f"MixedPrecision(..., fp8={{'exclude': [{layer!r}]}})")

    saturated = [c for c in ev.fp8 if c.saturated]
    if f.zero >= FP8_FLUSH_ALARM and w.sqnr_db >= ALARM_DB:  # the SQNR does not see a lost population
        return Finding("fp8-casts", title, "alarm",
                       f"{f.layer}'s {f.role} cast flushes {_pct(f.zero)} of its nonzero values to 0 (SQNR "
                       f"{f.sqnr_db:.1f} dB: the large values carry the norm, the rest is lost)", evidence,
                       fix(f.layer), f.layer, cause="fp8-cast-flush")
    if not w.sqnr_db >= ALARM_DB:
        return Finding("fp8-casts", title, "alarm", f"{w.layer}'s {w.role} cast keeps almost nothing: SQNR "
                       f"{w.sqnr_db:.1f} dB, {_pct(w.zero)} of its values flushed to 0", evidence, fix(w.layer), w.layer,
                       cause="fp8-cast-loss")
    if w.sqnr_db < WARN_DB or saturated or f.zero >= FP8_FLUSH_WARN:
        what = (f"{saturated[0].layer}'s {saturated[0].role} saturates ({_pct(saturated[0].saturation)} of values)"
                if saturated else f"{w.layer}'s {w.role} cast has an SQNR of {w.sqnr_db:.1f} dB (< {WARN_DB:g})"
                if w.sqnr_db < WARN_DB else f"{f.layer}'s {f.role} cast flushes {_pct(f.zero)} of its nonzero values to 0")
        layer = saturated[0].layer if saturated else w.layer if w.sqnr_db < WARN_DB else f.layer
        return Finding("fp8-casts", title, "warn", what, evidence, fix(layer), layer, cause="fp8-cast-loss")
    return Finding("fp8-casts", title, "ok", f"every fp8 cast keeps at least {w.sqnr_db:.1f} dB SQNR, none saturates, "
                   f"none flushes {_pct(FP8_FLUSH_WARN)} of its values ({len(ev.fp8)} casts in "
                   f"{len({c.layer for c in ev.fp8})} layers, {when})", evidence)


CHECKLIST = (check_recipe_step, check_fp32, check_loss_fp32, check_unscale_clip, check_math_domain,
             check_norm_variance, check_bf16, check_activation_range, check_grad_underflow,
             check_update_vanishing, check_loss_scale, check_fp8_casts)


def run_checklist(ev: Evidence) -> list[Finding]:
    out = []
    for check in CHECKLIST:
        try:
            out.append(check(ev))
        except Exception as e:  # a check must not hide the others
            out.append(Finding(check.__name__.removeprefix("check_").replace("_", "-"), check.__name__, "skipped",
                               f"the check failed: {type(e).__name__}: {e}"))
    return out


def _f16() -> Any:
    return get_format("f16").dtype


def _bf16() -> Any:
    return get_format("bf16").dtype
