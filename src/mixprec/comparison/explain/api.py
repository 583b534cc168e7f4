"""``explain()``: why a recipe does not track fp32 on a task, and the smallest change that makes it.

>>> e = explain("fragile", "bf16-pure", steps=60)  # doctest: +SKIP
>>> e.status, e.fix.code  # doctest: +SKIP
('FIXED', "MixedPrecision('bf16-true')")

The order of work (docs/compare.md, "Why a recipe diverges"):

1. the comparison (``compare``), or the one given: its fp32 runs and noise band are reused;
2. fp32 itself first (check 1): unstable or non-finite fp32 ends it there, with that answer;
3. where the error enters: ``capture`` measures every module against fp32 at a few steps of the
   run that diverged;
4. each hypothesis's single changes, trained on a short horizon (the step it failed at, plus a
   margin) and judged by the comparison's band, in ``jobs`` processes; then the island search
   (``search``) when the whole forward in fp32 tracks and no smaller kind of change did;
5. the fix: the smallest change that tracked (``candidates.PREFERENCE``), verified on all the
   comparison's steps against its band, with its step time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from mixprec.comparison.api import MIN_NOISE_SEEDS, REFERENCE, ComparisonResult, _torch_threads, compare
from mixprec.comparison.explain.candidates import BandWatch, Candidate, Evaluator, Outcome
from mixprec.comparison.explain.capture import ROOT, Capture, capture
from mixprec.comparison.explain.hypotheses import (
    conclude, fp32_stability, island_candidate, loss_candidates, masters_candidates, scale_candidates, search_tree,
)
from mixprec.comparison.explain.result import Explanation, Finding, Fix
from mixprec.comparison.explain.search import IslandSearch, Tree
from mixprec.comparison.runner import run_recipe
from mixprec.comparison.verdict import Verdict, VerdictRule, judge
from mixprec.formats import short_name
from mixprec.instruments.reductions import OUTSIDE
from mixprec.recipes import Recipe, as_device, resolve_recipe
from mixprec.tasks import Task, load_task

#: captured steps at most (each costs a forward and backward of every module, twice)
CAPTURE_STEPS = 3


def explain(
    task: str | Task | Callable[..., Task] | None = None,
    recipe: str | Recipe = "bf16-mixed",
    *,
    comparison: ComparisonResult | None = None,
    steps: int | None = None,
    seeds: int | None = None,
    device: Any = None,
    out: str | None = None,
    task_kwargs: dict[str, Any] | None = None,
    rule: VerdictRule | None = None,
    threads: int | None = None,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Explanation:
    """Explain why ``recipe`` does not track fp32 on ``task`` (see the module doc for the order).

    Args:
        task, steps, seeds, device, task_kwargs, rule, threads: as for ``compare`` (``steps``,
            ``seeds`` and ``rule`` make the comparison when none is given).
        recipe: the recipe to explain (a name, a jmp policy string or a ``Recipe``).
        comparison: a ``ComparisonResult`` of this task that judged ``recipe`` (``compare --explain``
            passes its own): its fp32 runs and band are reused, nothing is compared again.
        out: a directory for explain.html, explain.png and explain.json.
        jobs: candidate runs trained at once, in worker processes (``task`` must then be a
            ``"module:function"`` name or a built-in one, which the workers import).
        progress: called with one line per stage, candidate and search step.

    Returns an ``Explanation``; ``status`` is TRACKS when there was nothing to explain.
    """
    t0 = time.perf_counter()
    if progress is not None and not callable(progress):
        raise TypeError(f"progress={progress!r}: need a function called with each line (print works), or None")
    say = progress or (lambda _m: None)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r}: need a positive integer (candidate runs trained at once)")
    if out is not None:
        from mixprec.comparison.explain.report import check_explain_dir

        check_explain_dir(out)
    dev = as_device(device)
    rec = resolve_recipe(recipe, dev)
    if rec.name == resolve_recipe(REFERENCE, dev).name:
        raise ValueError(f"recipe {rec.name!r} is fp32, the reference: there is nothing to explain; name a 16-bit recipe")
    if isinstance(task, Task) and task_kwargs:
        raise ValueError("task_kwargs go to a task factory; a ready Task takes none (pass its factory instead)")
    the_task = load_task(task, **(task_kwargs or {}))
    if comparison is None:
        seeds = MIN_NOISE_SEEDS if seeds is None else seeds
        say(f"comparing {rec.name} with fp32 ({seeds} extra fp32 seeds for the noise band)")
        comparison = compare(the_task, (REFERENCE, rec), steps=steps, seeds=seeds, device=dev, threads=threads, rule=rule)
    else:
        given = [k for k, v in (("steps", steps), ("seeds", seeds), ("rule", rule)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} make the comparison, but comparison= was given with its own "
                             f"({comparison.steps} steps, {len(comparison.noise)} extra seeds, its rule): drop them")
        _check_comparison(comparison, the_task, rec, dev)
    verdict = comparison.verdicts[rec.name]
    e = Explanation(the_task.name, rec.name, str(dev), comparison.steps, "TRACKS", "", verdict, comparison, base=rec,
                    jobs=jobs)
    first = fp32_stability(comparison) if comparison.band is not None or verdict.status == "UNJUDGED" else None
    if first is not None:
        e.findings.append(first)
    if first is not None and first.status == "HOLDS":
        e.status, e.summary = "FP32 UNSTABLE", f"check 1 first: {first.conclusion}"
    elif verdict.ok:
        e.summary = f"{rec.name} TRACKS fp32 within fp32's own noise ({verdict.message}): nothing to explain"
    elif verdict.status in ("ERROR", "UNJUDGED"):
        e.status = "ERROR"
        e.summary = (f"{rec.name} is {verdict.status} ({verdict.message}): explain hunts a numerical divergence; this "
                     "run did not diverge, it failed" if verdict.status == "ERROR" else verdict.message)
    else:
        with _torch_threads(threads):
            _hunt(e, the_task, task, task_kwargs or {}, rec, dev, jobs, threads, say)
    e.wall_s = time.perf_counter() - t0
    if out is not None:
        e.write(out)
    return e


def _check_comparison(c: ComparisonResult, task: Task, rec: Recipe, dev: Any) -> None:
    if rec.name not in c.verdicts:
        raise ValueError(f"the comparison judged {sorted(c.verdicts)}, not {rec.name!r}: compare that recipe first "
                         "(or pass comparison=None to let explain run it)")
    if c.task != task.name or c.device != str(dev):
        raise ValueError(f"the comparison ran task {c.task!r} on {c.device}, not {task.name!r} on {dev}: explain needs "
                         "the same task and device as the comparison whose runs it reuses")


def horizon(verdict: Verdict, comparison: ComparisonResult) -> int:
    """The short horizon: the step the recipe failed at plus a margin, enough for the rule to judge."""
    r = comparison.band.rule
    first = verdict.first_step or comparison.steps
    margin = max(2 * r.patience, math.ceil(first / 4))
    return int(min(comparison.steps, max(first + margin, r.warmup + 2 * r.patience)))


def capture_points(verdict: Verdict, run: Any, h: int) -> list[int]:
    """0-based steps to measure: the first, the one where it failed, and one between."""
    last = min((verdict.first_step or 1) - 1, h - 1, max(len(run.loss) - 1, 0))
    return sorted({0, last // 2, last})[:CAPTURE_STEPS]


def _hunt(e: Explanation, task: Task, spec: Any, task_kwargs: dict[str, Any], rec: Recipe, dev: Any, jobs: int,
          threads: int | None, say: Callable[[str], None]) -> None:
    comparison, verdict = e.comparison, e.verdict
    run = comparison.run_for(rec.name)
    h = e.horizon = horizon(verdict, comparison)
    points = capture_points(verdict, run, h)
    say(f"[1/3 where] {rec.name} {verdict.status} from step {verdict.first_step}: measuring every module against fp32 "
        f"at step{'s' if len(points) > 1 else ''} {', '.join(str(p + 1) for p in points)}")
    cap = e.capture = capture(task, rec, dev, points, expected_loss=run.loss, say=say)
    e.runs, e.module_count = 1, len(cap.modules)
    e.steps_trained = len(cap.losses)
    evaluator = Evaluator(task, spec, task_kwargs, dev, comparison.band, h, jobs=jobs, threads=threads, say=say)
    try:
        _hypotheses(e, evaluator, task, rec, run, cap, jobs, say)
        _choose_fix(e, evaluator, task, rec, dev, say)
    finally:
        evaluator.close()
    e.runs += evaluator.runs
    e.steps_trained += evaluator.steps_trained
    e.status = "FIXED" if e.fix is not None else "NOT FIXED"
    e.summary = _summary(e, rec)


def _hypotheses(e: Explanation, ev: Evaluator, task: Task, rec: Recipe, run: Any, cap: Capture, jobs: int,
                say: Callable[[str], None]) -> None:
    h = e.horizon or 0
    scale_ev, scale_c = scale_candidates(rec, run, cap, h)
    loss_ev, loss_c, loss16 = loss_candidates(rec, cap)
    masters_ev, masters_c = masters_candidates(rec, cap)
    tree = Tree(search_tree(cap))
    usable = set(tree.children) | {c for cs in tree.children.values() for c in cs}
    root = island_candidate(rec, [""], cap)
    entry = next((m.name for m in cap.entry_points() if m.name and m.name in usable), None)
    guess = island_candidate(rec, [entry], cap) if entry is not None else None
    islands_apply = not rec.pure  # a pure recipe is 16-bit everywhere by definition: no island
    single = [*scale_c, *loss_c, *masters_c, *([root] if islands_apply else []),
              *([guess] if guess is not None and islands_apply else [])]
    say(f"[2/3 hypotheses] {len(single)} single changes, {h} steps each at most (--jobs {jobs}): "
        + "; ".join(c.change for c in single))
    got = dict(zip(single, ev.evaluate(single)))

    def outs(cands: list[Candidate]) -> list[Outcome]:
        return [got[c] for c in cands]

    cheaper = [o for o in outs([*scale_c, *loss_c, *masters_c]) if o.tracks and o.candidate.hypothesis != "format"]
    if not islands_apply:
        e.findings += [Finding("islands", "NOT APPLICABLE", f"{rec.name} keeps the whole model in "
                               f"{short_name(rec.compute_dtype)} by definition (a pure recipe): it has no fp32 islands; a "
                               "mixed recipe keeps modules in fp32", _entry_lines(cap))]
        _other_findings(e, rec, scale_ev, outs(scale_c), loss_ev, outs(loss_c), loss16, masters_ev, outs(masters_c))
        return
    island_outs = [got[root]] + ([got[guess]] if guess is not None else [])
    search = IslandSearch(tree, lambda sets: _ask(ev, rec, cap, sets, search, tree, say), jobs)
    search.cache[frozenset([""])] = got[root].tracks
    found: list[str] | None = None
    if guess is not None:
        search.cache[frozenset([entry])] = got[guess].tracks
    if got[root].run is None or got[root].run.error is not None:  # it could not run: nothing is known of the forward
        why = got[root].run.error if got[root].run is not None else "it could not start"
        islands = Finding("islands", "NOT TESTED", f"the whole forward in fp32 could not be trained ({why}), so the "
                          "islands were not searched", [], island_outs)
    elif not got[root].tracks:
        islands = Finding("islands", "REJECTED", "even with the whole forward in fp32 it does not track: the cause is "
                          "not an op of the forward or backward", [], island_outs)
    elif guess is not None and got[guess].tracks:
        say(f"  [islands] {entry} alone tracks: looking inside it for a smaller island")
        found = search._descend(entry, frozenset())
    elif cheaper:
        islands = Finding("islands", "NOT TESTED", f"the whole forward in fp32 tracks, but a smaller kind of change "
                          f"already does ({cheaper[0].candidate.change}); an island set would work around that cause, "
                          "not name it, so none was searched for", [], island_outs)
    else:
        say(f"  [islands] the whole forward in fp32 tracks: searching {len(usable)} modules for the smallest island set "
            f"(at most {tree.bound()} runs)")
        found = search.run()
    e.search_runs = search.log.runs + len(island_outs)
    if found is not None:
        final = island_candidate(rec, found, cap)
        final_out = ev.evaluate([final])[0]  # asked during the search as a whole, or one more run now
        island_outs += [o for o in ev.outcomes if o.candidate.hypothesis == "islands" and o not in island_outs]
        if not final_out.tracks:
            islands = Finding("islands", "REJECTED", f"the search's set {[n or ROOT for n in found]} does not track as "
                              "a whole (the verdicts near the band's edge disagree): no island set is offered", [],
                              island_outs)
        elif found == [""] and tree.kids(""):
            islands = Finding("islands", "REJECTED", "only the whole forward in fp32 tracks: no part of the model smaller "
                              "than all of it does", [], island_outs)
        else:
            e.culprits = list(found)
            parent = {c: p for p, cs in tree.children.items() for c in cs}
            for c in found:  # (a caller that tracked as an island: the search went into it)
                if parent.get(c) and search.cache.get(frozenset([parent[c]])):
                    e.callers.setdefault(parent[c], []).append(c)
            whole = " (the model is one module: that is fp32 compute for all of it)" if found == [""] else ""
            cost = _step_cost(final_out, e.comparison.run_for(rec.name))
            islands = Finding("islands", "HOLDS", f"the smallest island set that tracks: {[n or ROOT for n in found]}"
                              f"{whole}{cost}",
                              [_culprit_line(cap, n) for n in found], island_outs, {"islands": found, "code": final.code(rec)})
    islands.evidence = _entry_lines(cap) + islands.evidence
    e.findings.append(islands)
    _other_findings(e, rec, scale_ev, outs(scale_c), loss_ev, outs(loss_c), loss16, masters_ev, outs(masters_c))


def _other_findings(e: Explanation, rec: Recipe, scale_ev: list[str], scale_o: list[Outcome], loss_ev: list[str],
                    loss_o: list[Outcome], loss16: bool, masters_ev: list[str], masters_o: list[Outcome]) -> None:
    e.findings += [
        conclude("masters", masters_ev, masters_o, none_why="not applicable: the parameters are stored in fp32, so "
                 "every update is kept" if not rec.stores_16bit else "the recipe keeps fp32 masters already"),
        _scale_finding(scale_ev, scale_o, rec),
        _loss_finding(e, loss_ev, loss_o, loss16),
    ]


def _loss_finding(e: Explanation, evidence: list[str], outcomes: list[Outcome], loss16: bool) -> Finding:
    """HOLDS when fp32 outputs (o=f32) track, or when a reduction that ran in 16 bits is inside the
    island set the search found (the island runs it in fp32: that is what fixed it)."""
    f = conclude("loss", evidence, outcomes, none_why=(
        "the loss was computed in 16 bits by the task's own loss function, which no recipe change reaches: compute "
        "it in fp32 (.float() before the loss)" if loss16 else "the loss was computed in fp32"))
    reductions = e.capture.reductions if e.capture is not None else ()
    inside = [r for r in reductions if any(_within(r.module, c) for c in e.culprits)]
    # a caller's own code reducing what the island found hands it (in fp32 now): the island fed the reduction
    fed = [r for r in reductions if r.module in e.callers and r not in inside]
    if inside or fed:
        where = ", ".join(f"{r.op} ({r.dtype}) in {r.module}" for r in inside[:4])
        where += ("; " if where and fed else "") + ", ".join(
            f"{r.op} ({r.dtype}) in {r.module}, fed in fp32 by the island set found "
            f"({', '.join(e.callers[r.module])})" for r in fed[:4])
        f.status = "HOLDS"
        f.conclusion = (f"a reduction in 16 bits: {where}{', inside the island set found (an island runs it in fp32)' if inside else ''}; "
                        + f.conclusion)
    elif f.status == "REJECTED" and not outcomes and not loss16:
        f.conclusion += "; no reduction that ran in 16 bits is inside an island set that fixes it"
    return f


def _within(module: str, island: str) -> bool:
    """Is a reduction recorded in ``module`` (ReductionTrace's names) inside ``island``?"""
    if module == OUTSIDE:
        return False  # the loss: outside every island
    name = "" if module == ROOT else module
    return island == "" or name == island or name.startswith(island + ".")


def _scale_finding(evidence: list[str], outcomes: list[Outcome], rec: Recipe) -> Finding:
    """HOLDS when a change of the loss scale tracks. bf16 tracking where no scale does says fp16's
    range is the fault (a forward overflow, which no loss scale reaches), not the scale."""
    if not outcomes:
        return conclude("scale", evidence, [], none_why=f"not applicable: the recipe computes in "
                        f"{short_name(rec.compute_dtype)}, which has fp32's range and needs no loss scale")
    scaled = [o for o in outcomes if o.candidate.hypothesis == "scale"]
    bf16 = [o for o in outcomes if o.candidate.hypothesis == "format"]
    f = conclude("scale", evidence, scaled, none_why="no loss-scale change applies to this recipe")
    f.outcomes = outcomes
    if f.status != "HOLDS" and any(o.tracks for o in bf16):
        f.conclusion = ("no loss scale tracks, bf16 does: fp16's range is the fault, in the forward (an overflow no "
                        "loss scale reaches) or in gradients no single scale fits; fp32 islands or bf16 fix it")
    return f


def _ask(ev: Evaluator, rec: Recipe, cap: Capture, sets: list[frozenset[str]], search: IslandSearch, tree: Tree,
         say: Callable[[str], None]) -> list[bool]:
    cands = [island_candidate(rec, sorted(s), cap) for s in sets]
    left = max(0, tree.bound() - search.log.runs - len(sets))
    say(f"  [islands] search run {search.log.runs + 1}" + (f"-{search.log.runs + len(sets)}" if len(sets) > 1 else "")
        + f": {'; '.join(c.change for c in cands)} (at most {left} more)")
    return [o.tracks for o in ev.evaluate(cands)]


def _step_cost(o: Outcome, failing: Any) -> str:
    """'; step time x1.04 the recipe's' from the short run's median step against the failing run's."""
    if o.run is None or not o.run.median_step_s > 0 or not failing.median_step_s > 0:
        return ""
    return (f"; step time x{o.run.median_step_s / failing.median_step_s:.2f} the recipe's (its {o.run.steps}-step run; "
            "indicative)")


def _entry_lines(cap: Capture) -> list[str]:
    u = cap.unit_roundoff
    entry = cap.entry_points()
    lines = [f"the loss itself made a non-finite value from finite model outputs (in {cap.loss_dtype})"] \
        if cap.loss_made_nonfinite else []
    for m in entry[:4] or cap.ranked()[:3]:
        how = ("makes a non-finite value from fp32's finite input"
               + (f" (first: {m.nonfinite_op})" if m.nonfinite_op else "")) if m.made_nonfinite else \
            f"adds {m.score:.2g} relative error by itself ({m.score / u:.3g} u, u = {u:.3g} in {cap.compute})"
        if m.grad_overflow:
            how += "; its backward overflowed at the loss scale"
        lines.append(f"{m.label} ({m.type}) {how}")
    if not entry:
        lines.insert(len(lines) - min(3, len(cap.ranked())), f"no module adds more than 16 u by itself (u = {u:.3g}); "
                     "the largest:")
    return lines


def _culprit_line(cap: Capture, name: str) -> str:
    m = cap.module(name)
    reds = [r for r in cap.reductions if r.module == (name or "(the model)")]
    what = f"{m.label} ({m.type}): output {m.out_dtype}"
    if m.made_nonfinite:
        what += ", non-finite from finite input" + (f": first at {m.nonfinite_op}" if m.nonfinite_op else "")
    elif m.added is not None:
        what += f", adds {m.added:.2g} forward / {m.grad_added if m.grad_added is not None else float('nan'):.2g} backward"
    if reds:
        what += "; in its own code, on 16-bit inputs: " + ", ".join(f"{r.op} ({r.dtype})" for r in reds)
    return what


def _fixable(o: Outcome, e: Explanation) -> bool:
    c = o.candidate
    if not o.tracks:
        return False
    if c.hypothesis != "islands":
        return True
    # any island set that tracked, once the islands hypothesis holds: the set it found first (the smallest), and
    # the others after it when that one fails over all the steps. (Compared as sets: the finding lists its islands
    # by rank, the candidate in forward order, and a set of two out of forward order never matched: a fix found
    # and verified was dropped for bf16, found by a probe.)
    return bool(e.culprits) and bool(e.findings) and any(f.hypothesis == "islands" and f.status == "HOLDS" for f in e.findings)


def _found_set(o: Outcome, e: Explanation) -> bool:
    """Whether ``o`` is the island set the islands finding names (verified before any other set)."""
    names = set(o.candidate.mp_options.get("fp32_modules", ()))
    return any(f.hypothesis == "islands" and f.status == "HOLDS" and set(f.detail.get("islands", ())) == names
               for f in e.findings)


def _choose_fix(e: Explanation, ev: Evaluator, task: Task, rec: Recipe, dev: Any, say: Callable[[str], None]) -> None:
    comparison = e.comparison
    # smallest kind of change first; fewer islands first; else the order they were proposed in (a
    # short run's step time is too noisy to choose by)
    tracking = sorted((o for o in ev.outcomes if _fixable(o, e)),
                      key=lambda o: (o.candidate.preference, not _found_set(o, e), len(o.candidate.mp_options.get("fp32_modules", ()))))
    recipe_step = comparison.run_for(rec.name).median_step_s
    for o in tracking:
        c = o.candidate
        if e.horizon == comparison.steps and o.run is not None:
            run = o.run
        else:
            say(f"[3/3 fix] verifying {c.change} over all {comparison.steps} steps")
            run = run_recipe(task, c.recipe, steps=comparison.steps, device=dev, label=f"{rec.name}, fixed: {c.change}",
                             mp_options=c.mp_options, stop=BandWatch(comparison.band, c.change))
            e.runs += 1
            e.steps_trained += run.steps
        verdict = o.full = judge(run, comparison.band)
        say(f"  [fix] {c.change}: {verdict.status} over {run.steps} steps")
        if not verdict.ok:
            _note_partial(e, o, verdict)
        if verdict.ok:
            e.fix = Fix(o, c.code(rec), verdict, run, run.median_step_s / recipe_step,
                        run.median_step_s / comparison.fp32_step_s)
            break
    best = {}
    for o in tracking:  # one per kind of change; none that failed over all the steps
        if (e.fix is not None and o is e.fix.outcome) or (o.full is not None and not o.full.ok):
            continue
        best.setdefault(o.candidate.hypothesis, o)
    e.alternatives = list(best.values())


def _note_partial(e: Explanation, o: Outcome, full: Verdict) -> None:
    """A change that tracked on the short horizon and not over all the steps removed a cause, not
    every one: its finding says so."""
    for f in e.findings:
        if o in f.outcomes:
            f.conclusion += (f"; but over all {e.steps} steps {o.candidate.change} {full.status}"
                             + (f" from step {full.first_step}" if full.first_step else "") + ": it removes a cause, "
                             "not every one")


def _summary(e: Explanation, rec: Recipe) -> str:
    v = e.verdict
    held = [f.title for f in e.findings if f.status == "HOLDS"]
    head = f"{rec.name} {v.status} from step {v.first_step}"
    cause = f"; what holds: {'; '.join(held)}" if held else "; no single hypothesis holds"
    where = f" (at {', '.join(n or ROOT for n in e.culprits)})" if e.culprits else ""
    if e.fix is not None:
        return f"{head}{cause}{where}. Fix, verified over all {e.steps} steps: {e.fix.change}"
    return f"{head}{cause}{where}. No change tested made it TRACK on {e.horizon} steps"
