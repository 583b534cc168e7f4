"""A candidate fix: the recipe with one thing changed, trained on a short horizon and judged by the
comparison's own fp32 noise band.

``Candidate`` is the change (a recipe, and ``MixedPrecision`` keyword arguments as a user passes
them), ``Evaluator`` trains candidates (in ``jobs`` worker processes when asked), stopping each
one the moment the verdict can no longer be TRACKS: its smoothed loss has been outside the band
for the rule's patience, or a loss went non-finite. Judging a prefix of a run gives the same
status and first step as judging the whole run would (the smoothing at a step reads only the
steps before it), so an early stop changes no verdict, only the cost.

The band is the comparison's, cut to the horizon: the same fp32 runs, the same rule resolved for
the comparison's number of steps. Nothing fp32 is trained again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mixprec.comparison.runner import RunResult, run_recipe
from mixprec.comparison.verdict import Band, Verdict, judge
from mixprec.recipes import Recipe, list_recipes
from mixprec.tasks import Task, TaskError

#: How much a change departs from the recipe, smallest first: the fix is the first that tracks.
PREFERENCE = {"scale": 0, "loss": 1, "islands": 2, "masters": 3, "format": 4}


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
    """The recipe with one change. ``options``: ``MixedPrecision`` keyword arguments, as pairs."""

    hypothesis: str  # a key of PREFERENCE
    change: str  # what differs from the recipe, in a few words
    recipe: Recipe
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def mp_options(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def key(self) -> tuple[Recipe, str]:
        """Two candidates that train alike have the same key (the evaluator trains one of them)."""
        return self.recipe, repr(self.options)

    @property
    def preference(self) -> int:
        return PREFERENCE[self.hypothesis]

    def code(self, base: Recipe) -> str:
        """The line to paste: ``MixedPrecision(<recipe>, <options>)``."""
        parts = [recipe_expression(self.recipe, base)]
        parts += [f"{k}={_literal(v)}" for k, v in self.options]
        return f"MixedPrecision({', '.join(parts)})"


def _literal(v: Any) -> str:
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, float) and v.is_integer() and v >= 2 and (int(v) & (int(v) - 1)) == 0:
        return f"2.0**{int(v).bit_length() - 1}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def same_recipe(a: Recipe, b: Recipe) -> bool:
    """Whether two recipes train alike (names, descriptions and a static scale no scaler uses aside)."""
    def key(r: Recipe) -> Recipe:
        r = dataclasses.replace(r, name="", description="", reason="")
        return r if r.loss_scaling == "static" else dataclasses.replace(r, static_scale=0.0)
    return key(a) == key(b)


def registered_name(recipe: Recipe) -> str | None:
    """The registered recipe that trains like ``recipe`` (its name), if any."""
    for r in list_recipes():
        if same_recipe(r, recipe):
            return r.name
    return None


def recipe_expression(recipe: Recipe, base: Recipe) -> str:
    """``"bf16-true"`` for a registered recipe; else ``dataclasses.replace(...)`` of the base."""
    name = registered_name(recipe)
    if name is not None:
        return repr(name)
    policy = _as_policy_string(recipe)
    if policy is not None:
        return repr(policy)
    changes = []
    for f in dataclasses.fields(Recipe):
        if f.name in ("name", "description", "reason"):
            continue
        if getattr(recipe, f.name) != getattr(base, f.name):
            changes.append(f"{f.name}={_policy_or(getattr(recipe, f.name))}")
    base_name = registered_name(base)
    inner = f"mixprec.get_recipe({base_name!r})" if base_name else f"recipe  # your {base.name!r}"
    if not changes:
        return inner
    if base_name is None:
        return f"dataclasses.replace(recipe, {', '.join(changes)})  # recipe: your {base.name!r}"
    return f"dataclasses.replace({inner}, {', '.join(changes)})"


def _as_policy_string(recipe: Recipe) -> str | None:
    """The jmp policy string that resolves to a recipe training like ``recipe``, if one does."""
    from mixprec.recipes import resolve_recipe

    try:
        return str(recipe.policy) if same_recipe(resolve_recipe(str(recipe.policy), "cpu"), recipe) else None
    except (ValueError, RuntimeError):
        return None


def _policy_or(v: Any) -> str:
    from mixprec.policy import Policy

    return f"mixprec.get_policy({str(v)!r})" if isinstance(v, Policy) else _literal(v)


@dataclasses.dataclass
class Outcome:
    """A candidate as trained: its run (None when it could not start) and its verdict."""

    candidate: Candidate
    verdict: Verdict
    run: RunResult | None
    horizon: int
    seconds: float
    full: Verdict | None = None  # over all the comparison's steps, when it was verified

    @property
    def tracks(self) -> bool:
        return self.verdict.ok


def cut_band(band: Band, steps: int) -> Band:
    """The band of the first ``steps`` steps, judged by the same (resolved) rule."""
    return Band(band.center[:steps], band.width[:steps], band.noise_gap[:steps], band.rule)


class _Prefix:
    """What ``judge`` reads of a run, for the losses seen so far (no scaler: the status is what matters)."""

    loss_scaling, error, scale, skipped = "none", None, np.zeros(0), np.zeros(0, dtype=bool)

    def __init__(self, label: str, recipe: str, loss: list[float]) -> None:
        self.label, self.recipe, self.loss = label, recipe, np.asarray(loss, dtype=np.float64)


class BandWatch:
    """``run_recipe``'s ``stop``: ends a run once it cannot TRACK any more (module doc)."""

    def __init__(self, band: Band, label: str) -> None:
        self.band, self.label, self.losses = band, label, []

    def __call__(self, done: int, loss: torch.Tensor) -> str | None:
        self.losses.append(float(loss))
        v = judge(_Prefix(self.label, self.label, self.losses), self.band)  # type: ignore[arg-type]
        if v.status in ("DIVERGES", "NON-FINITE"):
            return f"stopped at step {done}: {v.status} from step {v.first_step} on the short horizon"
        return None


def train_candidate(task: Task, cand: Candidate, band: Band, horizon: int, device: str, seed: int = 0) -> Any:
    """One candidate run (in this process or a worker): a ``RunResult``, or the text of a ``TaskError``."""
    label = cand.change
    try:
        return run_recipe(task, cand.recipe, seed=seed, steps=horizon, device=device, role="candidate",
                          label=label, mp_options=cand.mp_options, stop=BandWatch(band, label))
    except (TaskError, ValueError, RuntimeError) as e:  # an option the model refuses, a recipe the device cannot run
        return f"{type(e).__name__}: {e}"


class Evaluator:
    """Trains candidates on ``horizon`` steps and judges them on ``band`` cut to it (module doc).

    ``jobs`` > 1 starts that many worker processes (``workers.WorkerPool``, each importing the task
    from ``spec``, which must then be a ``"module:function"`` name, a built-in name or None).
    """

    def __init__(self, task: Task, spec: Any, task_kwargs: dict[str, Any], device: torch.device, band: Band,
                 horizon: int, *, jobs: int = 1, threads: int | None = None, seed: int = 0,
                 say: Callable[[str], None] | None = None) -> None:
        if jobs > 1 and spec is not None and not isinstance(spec, str):
            raise TaskError("--jobs starts worker processes, which import the task: give it as 'module:function' "
                            f"(or a built-in name), not a {type(spec).__name__}")
        self.task, self.device, self.horizon, self.seed = task, str(device), horizon, seed
        self.band = cut_band(band, horizon)
        self.say = say or (lambda _m: None)
        self.jobs = jobs
        self.outcomes: list[Outcome] = []
        self._cache: dict[tuple[Recipe, str], Outcome] = {}
        self._pool: Any = None
        if jobs > 1:
            from mixprec.comparison.explain.workers import WorkerPool

            per = threads or max(1, (os.cpu_count() or 1) // jobs)
            self._pool = WorkerPool(jobs, {"task": spec, "task_kwargs": task_kwargs, "threads": per})

    @property
    def runs(self) -> int:
        return len(self.outcomes)

    @property
    def steps_trained(self) -> int:
        return sum(o.run.steps for o in self.outcomes if o.run is not None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def evaluate(self, cands: Sequence[Candidate]) -> list[Outcome]:
        """Train each candidate not trained before (in parallel with ``jobs``); outcomes in order."""
        todo = [c for c in {c.key: c for c in cands}.values() if c.key not in self._cache]
        results: dict[Candidate, tuple[Any, float]] = {}
        if self._pool is None:
            for c in todo:
                t0 = time.perf_counter()
                results[c] = (train_candidate(self.task, c, self.band, self.horizon, self.device, self.seed),
                              time.perf_counter() - t0)
                self._record(c, *results[c])
        else:  # one thread per job waits on a worker process; the training happens there
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs) as threads:
                job = (self.band, self.horizon, self.device, self.seed)
                futures = {threads.submit(self._pool.run, (train_candidate, (c, *job))): c for c in todo}
                for f in concurrent.futures.as_completed(futures):
                    c = futures[f]
                    results[c] = (f.result(), time.perf_counter() - t0)
            for c in todo:  # recorded in the order asked, not as they finished: the report is the same every time
                self._record(c, *results[c])
        return [self._cache[c.key] for c in cands]

    def _record(self, c: Candidate, got: Any, seconds: float) -> None:
        if isinstance(got, str):
            verdict = Verdict(c.change, c.recipe.name, "ERROR", got)
            outcome = Outcome(c, verdict, None, self.horizon, seconds)
        else:
            outcome = Outcome(c, judge(got, self.band), got, self.horizon, seconds)
        self._cache[c.key] = outcome
        self.outcomes.append(outcome)
        run = outcome.run
        steps = f"{run.steps}/{self.horizon} steps" if run is not None else "did not start"
        self.say(f"  [{c.hypothesis}] {c.change}: {outcome.verdict.status} ({steps}, {seconds:.2f} s; run {self.runs})")
