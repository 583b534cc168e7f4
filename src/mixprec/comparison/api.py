"""``compare()``: train a task under each recipe and fp32 from several seeds, and judge the curves.

>>> result = compare(recipes=("fp32", "bf16-mixed"), steps=30, task_kwargs={"d_model": 16})  # doctest: +SKIP
>>> result.ok, result.verdicts["bf16-mixed"].status  # doctest: +SKIP
(True, 'TRACKS')
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

import mixprec
from mixprec.comparison.runner import ProgressFn, RunResult, RunStartFn, check_task, run_plan, time_interleaved
from mixprec.instruments.machine import environment
from mixprec.comparison.verdict import Band, Verdict, VerdictRule, fp32_band, identical_to_reference, judge
from mixprec.formats import is_floating_16bit
from mixprec.recipes import Recipe, as_device, resolve_recipe
from mixprec.tasks import Task, load_task

DEFAULT_RECIPES = ("fp32", "bf16-mixed", "fp16-mixed")
REFERENCE = "fp32"
REFERENCE_SEED = 0
MIN_NOISE_SEEDS = 2



@dataclasses.dataclass
class ComparisonResult:
    """What ``compare`` measured and decided.

    Attributes:
        task: the task's name; ``description`` its one line.
        device: where it ran.
        steps: optimizer steps per run.
        runs: every run: the fp32 reference (seed 0), fp32 noise runs, then the candidates.
        verdicts: recipe name -> ``Verdict``, for each candidate recipe (fp32 itself is the reference).
        band: the fp32 noise band (None when fp32 was not finite).
        rule: the verdict rule (``rule.describe(steps)`` states it).
        wall_s: the whole comparison.
        threads: torch's CPU threads during the runs.
        files: report files written (name -> path), when ``out`` was given.
        write_error: why the report could not be written to ``out`` (the results are all here:
            ``result.write(other_dir)``), else None.
        timing: recipe name -> seconds per step from the interleaved timing rounds
            (``runner.time_interleaved``), fp32 included; None when they did not run (then the speed
            comes from the sequential runs: indicative only).
    """

    task: str
    description: str
    device: str
    steps: int
    runs: list[RunResult]
    verdicts: dict[str, Verdict]
    band: Band | None
    rule: VerdictRule
    wall_s: float
    threads: int = 0
    timing: dict[str, list[float]] | None = None
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    write_error: str | None = None

    def write(self, out: str) -> dict[str, str]:
        """Write the report (HTML, PNG, JSON, CSV) into ``out``; returns name -> path."""
        from mixprec.comparison.report import write_report

        self.files = write_report(self, out)
        self.write_error = None
        return self.files

    @property
    def ok(self) -> bool:
        """True when every candidate recipe TRACKS fp32 (and there was a finite fp32 to track)."""
        return bool(self.verdicts) and all(v.ok for v in self.verdicts.values())

    @property
    def reference(self) -> RunResult:
        return next(r for r in self.runs if r.role == "reference")

    @property
    def noise(self) -> list[RunResult]:
        return [r for r in self.runs if r.role == "noise"]

    def run_for(self, recipe: str) -> RunResult:
        """The seed-0 run of ``recipe`` (the reference for fp32)."""
        for r in self.runs:
            if r.recipe == recipe and r.role != "noise":
                return r
        raise KeyError(f"no run for recipe {recipe!r}; recipes run: {[r.recipe for r in self.runs if r.role != 'noise']}")

    @property
    def fp32_step_s(self) -> float:
        """fp32's step time: the median over every fp32 run (reference and noise seeds pooled).

        The baseline of ``step_time_ratio``; pooling the seeds makes it steadier than one run.
        """
        return float(np.median([r.median_step_s for r in self.runs if r.role in ("reference", "noise")]))

    def step_time_ratio(self, recipe: str) -> float:
        """Median step time of ``recipe`` over ``fp32_step_s``; > 1 means slower. 1.0 for fp32 itself."""
        run = self.run_for(recipe)
        if run.role == "reference":
            return 1.0
        return run.median_step_s / self.fp32_step_s

    def speedup(self, recipe: str) -> float:
        """fp32's step time over ``recipe``'s: > 1 means faster than fp32 (the convention every
        mixprec table uses). From the interleaved timing rounds when they ran (the median of the
        per-round ratios, ``speed_interval``), else from the sequential runs (``fp32_step_s`` over
        the run's median step: indicative, load drifting between runs moves it)."""
        ratio = self.speed_interval(recipe)
        return ratio["median"] if ratio is not None else 1.0 / self.step_time_ratio(recipe)

    @property
    def speed_method(self) -> str:
        return "interleaved" if self.timing else "sequential"

    def speed_interval(self, recipe: str) -> dict[str, float] | None:
        """The interleaved rounds' fp32/``recipe`` step-time ratio: median, IQR and a 95% bootstrap
        interval of the median (None without interleaved timing for it)."""
        t = self.timing or {}
        if recipe not in t or REFERENCE not in t:
            return None
        from mixprec.instruments.timing import paired_ratio

        return paired_ratio(t[REFERENCE], t[recipe])

    def machine(self) -> dict[str, Any]:
        """Where the runs ran (``mixprec.instruments.machine.environment``; the JAX result describes jax's): the
        runs' thread count, not the caller's after compare restored it."""
        return {**environment(self.device), "threads": self.threads or torch.get_num_threads()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "mixprec_compare": 1,
            "mixprec": mixprec.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "task": {"name": self.task, "description": self.description, "steps": self.steps},
            "device": self.device,
            "threads": self.threads,
            "ok": self.ok,
            "wall_s": self.wall_s,
            "rule": self.rule.to_dict(self.steps),
            "verdicts": {k: v.to_dict() for k, v in self.verdicts.items()},
            "step_time_ratio_vs_fp32": {
                r.recipe: _round(self.step_time_ratio(r.recipe)) for r in self.runs if r.role != "noise"
            },
            "speedup_vs_fp32": {r.recipe: _round(self.speedup(r.recipe)) for r in self.runs if r.role != "noise"},
            "speed": {"method": self.speed_method, "rounds": len(next(iter(self.timing.values()))) if self.timing else 0,
                      "speedup_vs_fp32": {k: self.speed_interval(k) for k in (self.timing or {})},
                      "samples_s": self.timing or {}},
            "machine": self.machine(),
            "band": None if self.band is None else {
                "center": self.band.center.tolist(),
                "width": self.band.width.tolist(),
                "noise_gap": self.band.noise_gap.tolist(),
                "seeds_identical": self.band.seeds_identical,
                "warning": self.band.warning,
            },
            "runs": [r.to_dict() for r in self.runs],
            "files": dict(self.files),
        }

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _round(x: float) -> float | None:
    return round(x, 4) if x == x and abs(x) != float("inf") else None


def _resolve_all(recipes: Sequence[str | Recipe], device: torch.device) -> list[Recipe]:
    """Resolve every recipe before training anything: a typo should not cost a minute of fp32 runs."""
    if isinstance(recipes, (str, Recipe)):
        recipes = [recipes]
    resolved: list[Recipe] = []
    asked: dict[str, str] = {}  # recipe name -> the first spelling that named it
    failed: list[Exception] = []
    for spec in recipes:
        try:
            recipe = resolve_recipe(spec, device)
        except (ValueError, TypeError) as e:  # every bad name said at once, not one per run
            failed.append(e)
            continue
        first = asked.setdefault(recipe.name, spec if isinstance(spec, str) else recipe.name)
        if isinstance(spec, str) and spec != first:  # 'fp8' and 'fp8-current': one recipe, one row, said
            warnings.warn(f"{first!r} and {spec!r} name the same recipe ({recipe.name}): it runs once, in one row",
                          UserWarning, stacklevel=3)
        out = recipe.policy.output_dtype
        if isinstance(spec, str) and "=" in spec and out in (torch.float16, torch.bfloat16):
            warnings.warn(
                f"policy {spec!r} means {recipe.policy}: the model's output, and so the loss, is "
                f"{str(out).removeprefix('torch.')} (jmp's grammar: output defaults to compute). For the usual "
                f"mixed recipe write o=f32: {str(recipe.policy).rsplit(',', 1)[0]},o=f32",
                UserWarning, stacklevel=3,
            )
        if all(r.name != recipe.name for r in resolved):
            resolved.append(recipe)
    if len(failed) > 1:
        heads = [str(e).split(" Expected one of")[0].rstrip(".") for e in failed]  # (the list of names once)
        tail = str(failed[0])[len(heads[0]):].lstrip(".")
        raise type(failed[0])(f"{len(failed)} recipes cannot run: {'; '.join(heads)}.{tail}") from failed[0]
    if failed:
        raise failed[0]
    if not resolved:
        raise ValueError("compare needs at least one recipe, e.g. recipes=('bf16-mixed',)")
    return resolved


def compare(
    task: str | Task | Callable[..., Task] | None = None,
    recipes: Sequence[str | Recipe] = DEFAULT_RECIPES,
    *,
    steps: int | None = None,
    seeds: int = MIN_NOISE_SEEDS,
    device: str | torch.device | None = None,
    out: str | None = None,
    rule: VerdictRule | None = None,
    task_kwargs: dict[str, Any] | None = None,
    threads: int | None = None,
    progress: ProgressFn | None = None,
    on_run: RunStartFn | None = None,
    nproc: int = 1,
    parallel: str = "ddp",
    timeout: float | None = None,
    timing_rounds: int = 10,
    force_nproc: bool = False,
) -> ComparisonResult:
    """Train ``task`` under each recipe and under fp32 from ``1 + seeds`` seeds; judge every recipe.

    Args:
        task: ``"module:function"``, a factory, a ``Task``, or None for the built-in char-level GPT.
        recipes: names ``resolve_recipe`` accepts or ``Recipe`` objects. fp32 always runs (seed 0)
            as the reference; listing it only shows it in the report.
        steps: optimizer steps per run (default: the task's).
        seeds: extra fp32 runs (seeds 1..seeds) that measure the noise; at least 2.
        device: "cpu", "cuda", ... (default: CUDA when available).
        out: a directory for the report (HTML, PNG, JSON, CSV); None writes nothing.
        rule: the verdict rule (default ``VerdictRule()``).
        task_kwargs: keyword arguments for the task factory.
        threads: torch CPU threads for the runs (restored afterwards); None leaves torch's setting.
        progress: called after every step (see ``runner.ProgressFn``).
        on_run: called before each run with ``(label, index, total)``.
        nproc: train every run data-parallel on this many local processes, started through torch's
            launcher (torchrun): each step's batch is split over them (``task`` must then be a
            ``"module:function"`` name or None, which the processes import).
        parallel: "ddp" or "fsdp" when ``nproc`` > 1; ``timeout``: seconds for all of it (then
            the processes are killed and a ``RuntimeError`` says so); None: no limit.
        timing_rounds: after the runs, time every recipe's step in this many interleaved rounds
            (``runner.time_interleaved``) for the speed column; 0 (or ``nproc`` > 1) takes it from
            the sequential runs instead, which is indicative only.
        force_nproc: start ``nproc`` CPU ranks even when the machine has fewer CPUs (refused otherwise).

    Raises ``TaskError`` for a task that cannot be used, ``ValueError`` for unknown recipes or bad
    arguments, ``RuntimeError`` for a recipe this device cannot run, ``RunError`` when an fp32
    run fails. A candidate recipe that fails while training gets the verdict ERROR instead.
    """
    t_start = time.perf_counter()
    if not isinstance(seeds, int) or seeds < MIN_NOISE_SEEDS:
        raise ValueError(
            f"seeds={seeds!r}: the noise band needs at least {MIN_NOISE_SEEDS} fp32 runs from other seeds "
            "(one gap is an anecdote, not a spread)"
        )
    if steps is not None and (not isinstance(steps, int) or steps < 2):
        raise ValueError(f"steps={steps!r}: need an integer >= 2")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r}: need a positive integer or None")
    if isinstance(timing_rounds, bool) or not isinstance(timing_rounds, int) or timing_rounds < 0 or timing_rounds == 1:
        raise ValueError(f"timing_rounds={timing_rounds!r}: need 0 (no interleaved timing) or an integer >= 2")
    for name, fn in (("progress", progress), ("on_run", on_run)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name}={fn!r}: need a function (it is called as training goes), or None")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: need a positive integer (1: every run on this process)")
    if not isinstance(force_nproc, bool):
        raise TypeError(f"force_nproc={force_nproc!r}: need True or False")
    dev = as_device(device)
    if nproc > 1:  # bounded by the machine before any process starts, as on the command line
        from mixprec.comparison.parallel import check_options

        check_options(nproc, parallel, device=dev, force=force_nproc)
    if out is not None:
        from mixprec.comparison.report import check_out_dir

        check_out_dir(out)  # before training: a clash should not cost the user a minute of runs
    reference_recipe = resolve_recipe(REFERENCE, dev)
    resolved = _resolve_all(recipes, dev)
    candidates = [r for r in resolved if r.name != reference_recipe.name]
    if not candidates:
        why = "".join(f" ({r.reason})" for r in resolved if r.reason.startswith("auto"))
        raise ValueError(
            f"recipes {list(recipes)!r} name only fp32{why}, the reference every recipe is judged against; "
            "add a recipe to compare with it, e.g. 'bf16-mixed'"
        )
    if isinstance(task, Task) and task_kwargs:
        raise ValueError("task_kwargs go to a task factory; a ready Task takes none (pass its factory instead)")
    the_task = load_task(task, **(task_kwargs or {}))
    check_task(the_task)
    n_steps = the_task.steps if steps is None else steps
    rule = rule or VerdictRule()

    plan = make_plan(reference_recipe, candidates, seeds)
    with _torch_threads(threads):
        threads_used = torch.get_num_threads()
        if nproc > 1:
            from mixprec.comparison.parallel import run_plan_on_ranks  # starts torchrun: only when asked for

            runs = run_plan_on_ranks(task, task_kwargs or {}, plan, n_steps, dev, nproc, parallel, threads,
                                     progress=progress, on_run=on_run, timeout=timeout)
        else:
            runs = run_plan(the_task, plan, n_steps, dev, progress=progress, on_run=on_run)
        timing = None
        if nproc == 1 and timing_rounds and all(np.isfinite(r.loss).all() for r in runs if r.role != "candidate"):
            timed = [reference_recipe] + [c for c in candidates if not any(r.recipe == c.name and r.error for r in runs)]
            timing = time_interleaved(the_task, timed, dev, timing_rounds) or None
    verdicts, band = _judge(runs, candidates, seeds, rule)

    result = ComparisonResult(
        task=the_task.name,
        description=the_task.description,
        device=str(dev),
        steps=n_steps,
        runs=runs,
        verdicts=verdicts,
        band=band,
        rule=rule,
        wall_s=0.0,
        threads=threads_used,
        timing=timing,
    )
    result.wall_s = time.perf_counter() - t_start
    if out is not None:
        try:
            result.write(out)
        except OSError as e:  # checked before training, so something changed since: keep the results
            result.write_error = f"the report could not be written to {str(out)!r}: {e}"
            warnings.warn(result.write_error + "; the results are in the returned object (result.write(dir))",
                          RuntimeWarning, stacklevel=2)
    return result


Plan = list[tuple[Recipe, int, str]]  # (recipe, seed, role) per run, in order


def make_plan(reference: Recipe, candidates: Sequence[Recipe], seeds: int) -> Plan:
    """The runs of a comparison: fp32 from seed 0, fp32 from ``seeds`` other seeds, each candidate."""
    plan: Plan = [(reference, REFERENCE_SEED, "reference")]
    plan += [(reference, REFERENCE_SEED + i, "noise") for i in range(1, seeds + 1)]
    return plan + [(r, REFERENCE_SEED, "candidate") for r in candidates]


def _judge(runs: list[RunResult], candidates: Sequence[Recipe], seeds: int,
           rule: VerdictRule) -> tuple[dict[str, Verdict], Band | None]:
    verdicts: dict[str, Verdict] = {}
    band: Band | None = None
    by_name = {r.name: r for r in candidates}
    for run in runs:
        if run.role != "candidate" and not np.isfinite(run.loss).all():
            # check 1 of the debugging order: if fp32 is not finite either, the precision is not the fault
            why = _fp32_failed(run)
            return {r.name: Verdict(r.name, r.name, "UNJUDGED", why) for r in candidates}, band
        if run.role == "noise" and run.seed == REFERENCE_SEED + seeds:
            band = fp32_band(runs[0].loss, [r.loss for r in runs[1:] if r.role == "noise"], rule)
        if run.role == "candidate":
            assert band is not None
            low = _low_precision(by_name[run.recipe])
            same = identical_to_reference(run, runs[0].loss, low) if low else None
            verdicts[run.recipe] = same if same is not None else judge(run, band)
    return verdicts, band


def _low_precision(recipe: Recipe) -> str | None:
    """The precision below fp32 a recipe computes or stores in ("bf16", "fp16", "fp8"); None for one that is
    all fp32 (a jmp policy such as p=f32,c=f32,o=f32 reproduces fp32 exactly, as it should)."""
    if recipe.fp8 is not None:
        return "fp8"
    for dtype in (recipe.policy.compute_dtype, recipe.policy.param_dtype):
        if is_floating_16bit(dtype):
            return "fp16" if dtype == torch.float16 else "bf16"
    return None


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Set torch's CPU threads for the runs and restore them after (None: leave them alone)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fp32_failed(run: RunResult) -> str:
    bad = np.flatnonzero(~np.isfinite(run.loss))
    return (
        f"fp32 itself ({run.label}) has a non-finite loss at step {int(bad[0]) + 1}: the fault is not the "
        "precision. Fix the model, data or learning rate in fp32 first (check 1 of the debugging order)."
    )
