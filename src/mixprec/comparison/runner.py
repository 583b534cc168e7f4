"""Train one task under one recipe from one seed, and record what every step did.

A run reads nothing from the device while it trains, except what the progress display asks for
and a cheap finiteness check every few steps: the per-step ``StepStats`` are device tensors,
stacked and copied to the host once at the end.

What a seed controls: ``torch.manual_seed(seed)`` runs just before ``task.build_model()``, so it
sets the model's initial weights (and any randomness in the forward, such as dropout). The data
does not depend on it: ``task.get_batch(step)`` is the same for every run, which ``check_task``
verifies before training.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from mixprec.recipes import Recipe
from mixprec.tasks import Task, TaskError, to_device
from mixprec.training import MixedPrecision

Role = Literal["reference", "noise", "candidate"]

#: called as ``progress(run_label, steps_done, steps_total, latest_loss_tensor)`` after each step
ProgressFn = Callable[[str, int, int, torch.Tensor], None]
#: called as ``on_run(label, index, total)`` before each run starts
RunStartFn = Callable[[str, int, int], None]
#: called as ``stop(steps_done, latest_loss_tensor)`` after each step; a string stops the run (the reason)
StopFn = Callable[[int, torch.Tensor], "str | None"]


class RunError(RuntimeError):
    """A run failed while training; ``label`` and ``step`` say which run and where."""

    def __init__(self, label: str, step: int, error: BaseException) -> None:
        self.label, self.step, self.error = label, step, error
        super().__init__(f"{label} failed at step {step}: {type(error).__name__}: {error}")


@dataclasses.dataclass
class RunResult:
    """One training run: its identity and per-step records (host numpy arrays, one entry per step).

    Attributes:
        label: e.g. ``"fp32 (seed 1)"``.
        recipe: the recipe's name; ``policy`` and ``loss_scaling`` describe it.
        seed: the ``torch.manual_seed`` before ``build_model``.
        role: ``reference`` (fp32, seed 0), ``noise`` (fp32, other seeds) or ``candidate``.
        loss: the unscaled fp32 loss of each step (NaN/inf kept as they were).
        grad_norm: total gradient norm before clipping.
        scale: the loss scale each step's backward used (1.0 without a scaler).
        skipped: whether each optimizer step was skipped for inf/NaN gradients.
        step_time_s: wall time of each step (batch, forward, backward, optimizer).
        peak_memory_bytes: peak allocated device memory (CUDA); None where not measurable (CPU).
        wall_s: the whole run, model building included.
        steps_requested: the steps asked for; ``len(loss)`` is less when the run stopped early.
        stopped: why the run stopped early (None when it ran all steps).
        error: the failure of a candidate run that raised (its records end at the failing step).
        notes: what every report showing this run's verdict must say (an fp8 run whose only fp8 layer is its LM head).
    """

    label: str
    recipe: str
    policy: str
    loss_scaling: str
    seed: int
    role: Role
    loss: np.ndarray
    grad_norm: np.ndarray
    scale: np.ndarray
    skipped: np.ndarray
    step_time_s: np.ndarray
    peak_memory_bytes: int | None
    wall_s: float
    steps_requested: int
    stopped: str | None = None
    error: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return len(self.loss)

    @property
    def skipped_steps(self) -> int:
        return int(self.skipped.sum())

    @property
    def median_step_s(self) -> float:
        """Median step time, the first step (allocation, autocast cache, warm-up) left out."""
        t = self.step_time_s[1:] if len(self.step_time_s) > 1 else self.step_time_s
        return float(np.median(t)) if len(t) else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "recipe": self.recipe,
            "policy": self.policy,
            "loss_scaling": self.loss_scaling,
            "seed": self.seed,
            "role": self.role,
            "steps": self.steps,
            "steps_requested": self.steps_requested,
            "stopped": self.stopped,
            "error": self.error,
            "notes": list(self.notes),
            "wall_s": self.wall_s,
            "median_step_s": _finite_or_none(self.median_step_s),
            "peak_memory_bytes": self.peak_memory_bytes,
            "skipped_steps": self.skipped_steps,
            "curves": {
                "loss": _json_list(self.loss),
                "grad_norm": _json_list(self.grad_norm),
                "scale": _json_list(self.scale),
                "skipped": [bool(s) for s in self.skipped],
                "step_time_s": _json_list(self.step_time_s),
            },
        }


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _json_list(a: np.ndarray) -> list[float | None]:
    """Floats for JSON; NaN and inf become null (strict JSON has neither; the verdict keeps them)."""
    return [float(v) if np.isfinite(v) else None for v in a.tolist()]


# ---------------------------------------------------------------------------- checks


def check_task(task: Task) -> None:
    """Refuse tasks whose data changes with the global seed: every run must see the same batches.

    Draws batches 0 and 1 under two different global seeds and compares them.
    """
    draws = []
    state = torch.random.get_rng_state()
    try:
        for seed in (12345, 54321):
            torch.manual_seed(seed)
            draws.append([_call_get_batch(task, step) for step in (0, 1)])
    finally:
        torch.random.set_rng_state(state)
    meta = _meta_tensor(draws[0])
    if meta is not None:
        raise TaskError(
            f"task {task.name!r}: get_batch(0) returned a tensor on the meta device ({meta}), which holds no data; "
            "return real tensors (on the CPU: compare moves them to --device)"
        )
    if not _same_nest(draws[0], draws[1]):
        raise TaskError(
            f"task {task.name!r}: get_batch(step) returned different batches under different global seeds. "
            "compare needs the same data in every run (only the model's initialisation changes with the "
            "seed); draw batches with a torch.Generator seeded from the step, e.g. "
            "torch.Generator().manual_seed(1000 + step)."
        )


def _call_get_batch(task: Task, step: int) -> tuple[Any, Any]:
    batch = task.get_batch(step)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TaskError(
            f"task {task.name!r}: get_batch({step}) returned {type(batch).__name__}"
            f"{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}; "
            "expected a pair (inputs, targets)"
        )
    return batch[0], batch[1]


def _meta_tensor(batch: Any) -> str | None:
    """A description of the first tensor on the meta device in a nest, else None."""
    if isinstance(batch, torch.Tensor):
        return f"{tuple(batch.shape)} {str(batch.dtype).removeprefix('torch.')}" if batch.is_meta else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((m for m in map(_meta_tensor, items) if m is not None), None)


def _same_nest(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # dicts, and a Hugging Face BatchEncoding (not a dict)
        return a.keys() == b.keys() and all(_same_nest(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_nest(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==: cannot check, do not refuse
        return True


def _build_model(task: Task, seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    model = task.build_model()
    if not isinstance(model, nn.Module):
        raise TaskError(
            f"task {task.name!r}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model.to(device)


# ---------------------------------------------------------------------------- timing


class _StepTimer:
    """Per-step wall times without a host sync per step.

    CPU ops run synchronously, so ``perf_counter`` between steps is the step time. CUDA work is
    queued: there, events recorded between steps are read once at the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> np.ndarray:
        if len(self.marks) < 2:
            return np.zeros(0)
        if self.cuda:
            self.marks[-1].synchronize()
            return np.array([a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])])
        return np.diff(np.array(self.marks))


# ---------------------------------------------------------------------------- one run


def run_recipe(
    task: Task,
    recipe: str | Recipe,
    *,
    seed: int = 0,
    steps: int | None = None,
    device: str | torch.device = "cpu",
    role: Role = "candidate",
    label: str | None = None,
    progress: ProgressFn | None = None,
    stop_after_nonfinite: int = 10,
    parallel: str | None = None,
    mp_options: dict[str, Any] | None = None,
    stop: StopFn | None = None,
) -> RunResult:
    """Train ``task`` for ``steps`` optimizer steps under ``recipe`` after ``torch.manual_seed(seed)``.

    The run stops early once the loss has been non-finite for ``stop_after_nonfinite`` steps in a
    row (nothing after that can recover: the weights are NaN). Raises ``TaskError`` when the task
    returns the wrong things, and ``RunError`` (with the step) when training raises.

    ``parallel`` ("ddp", "fsdp"): called on every rank of a process group, each rank trains on its
    slice of every batch (``shard_batch``) and records the loss averaged over the ranks.

    ``mp_options``: keyword arguments for ``MixedPrecision`` (``fp32_modules``, ``scaler``...), as a
    user would pass them with this recipe. ``stop``: see ``StopFn`` (``compare --explain`` stops a
    candidate as soon as it has left the fp32 band).
    """
    steps = task.steps if steps is None else int(steps)
    mp = MixedPrecision(recipe, device, track_grad_norm=True, **(mp_options or {}))
    dev = mp.device
    name = mp.recipe.name
    label = label or (name if role != "noise" else f"{name} (seed {seed})")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_start = time.perf_counter()
    model = _build_model(task, seed, dev)
    refused = None
    try:
        model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    except ValueError as e:
        from mixprec.fp8.state import Fp8Error  # an fp8 recipe with no fp8 layer here: an ERROR row, not a TRACKS

        if role != "candidate" or not isinstance(e, Fp8Error):
            raise TaskError(f"task {task.name!r} under recipe {name!r}: {e}") from None
        refused = RunError(label, 0, e)
    optimizer = task.build_optimizer(mp.parameters(model))  # fp32 masters for the -true recipes
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskError(
            f"task {task.name!r}: build_optimizer() returned {type(optimizer).__name__}, expected a "
            "torch.optim.Optimizer"
        )

    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    timer = _StepTimer(dev)
    stopped, error = None, refused
    check_every = 1 if dev.type == "cpu" else 10  # a CPU read is free; on CUDA it is a sync
    timer.mark()
    for step in range(steps if refused is None else 0):
        inputs = None
        try:
            inputs, targets = _call_get_batch(task, step)
            if parallel:
                inputs, targets = shard_batch(inputs, task), shard_batch(targets, task)
            inputs, targets = to_device(inputs, dev), to_device(targets, dev)
            with mp.autocast():
                outputs = task.run_forward(model, inputs)
            loss = task.loss_fn(outputs, targets)
            stats = mp.step(loss, optimizer, max_grad_norm=task.max_grad_norm)
        except TaskError:
            raise
        except Exception as e:  # in a candidate: a recipe this device or model cannot run
            if role == "candidate":
                error = RunError(label, step, e)
                break
            if step == 0 and task.forward is None and isinstance(inputs, Mapping):
                # model(inputs) with a dict of inputs: a Hugging Face model wants model(**inputs)
                raise TaskError(
                    f"task {task.name!r}, step 0 under {name!r}: {type(e).__name__}: {e}. The inputs are a mapping "
                    f"({sorted(map(str, inputs))}) and the task has no forward, so the model was called as "
                    "model(inputs); for a model that takes them as keywords set Task(forward=lambda model, batch: "
                    "model(**batch))"
                ) from e
            if step == 0 and isinstance(e, (TypeError, ValueError)):
                # the first step of the reference run: the task does not fit the protocol
                raise TaskError(f"task {task.name!r}, step 0 under {name!r}: {type(e).__name__}: {e}") from None
            raise RunError(label, step, e) from e
        timer.mark()
        grad_norm = stats.grad_norm if stats.grad_norm is not None else torch.full((), float("nan"), device=dev)
        if parallel:  # every rank's record is the mean over the ranks (a collective, every step)
            stats.loss = _mean_over_ranks(stats.loss.detach().float())
        records.append((stats.loss.detach().float(), grad_norm.detach().float(), stats.scale.detach().float(), stats.skipped))
        if progress is not None:
            progress(label, step + 1, steps, stats.loss)
        why = stop(step + 1, stats.loss) if stop is not None else None
        if why:
            stopped = why
            break
        n_bad = stop_after_nonfinite
        if (step + 1) % check_every == 0 and len(records) >= n_bad:
            recent = torch.stack([r[0] for r in records[-n_bad:]])
            if not bool(torch.isfinite(recent).any()):
                stopped = f"the loss was non-finite for {n_bad} steps in a row; stopped at step {step + 1}"
                break

    durations = timer.durations()
    if records:
        loss_t, gn_t, scale_t, skipped_t = (torch.stack(col).cpu() for col in zip(*records))
        loss_a, gn_a, scale_a = (t.double().numpy() for t in (loss_t, gn_t, scale_t))
        skipped_a = skipped_t.bool().numpy()
    else:
        loss_a = gn_a = scale_a = np.zeros(0)
        skipped_a = np.zeros(0, dtype=bool)
    peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
    return RunResult(
        label=label,
        recipe=name,
        policy=str(mp.recipe.policy),
        loss_scaling=mp.recipe.loss_scaling,
        seed=seed,
        role=role,
        loss=loss_a,
        grad_norm=gn_a,
        scale=scale_a,
        skipped=skipped_a,
        step_time_s=durations[: len(loss_a)],
        peak_memory_bytes=peak,
        wall_s=time.perf_counter() - t_start,
        steps_requested=steps,
        stopped=stopped,
        error=None if error is None else str(error),
        notes=(mp.fp8.note,) if mp.fp8 is not None and mp.fp8.note else (),
    )


def run_plan(task: Task, plan: list[tuple[Recipe, int, str]], steps: int, device: torch.device, *, progress: ProgressFn | None = None,
             on_run: RunStartFn | None = None, parallel: str | None = None) -> list[RunResult]:
    """Train every run of ``plan``; stops after an fp32 run whose loss is not finite (nothing can be
    judged against it). With ``parallel``, on every rank of a process group (see ``run_recipe``)."""
    runs: list[RunResult] = []
    for index, (recipe, seed, role) in enumerate(plan):
        label = recipe.name if role != "noise" else f"{recipe.name} (seed {seed})"
        if on_run is not None:
            on_run(label, index, len(plan))
        run = run_recipe(task, recipe, seed=seed, steps=steps, device=device, role=role,  # type: ignore[arg-type]
                         label=label, progress=progress, parallel=parallel)
        runs.append(run)
        if role != "candidate" and not np.isfinite(run.loss).all():
            break
    return runs


def time_interleaved(task: Task, recipes: list[Recipe], device: torch.device, rounds: int = 10,
                     warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per training step of each recipe, timed as ``mixprec bench`` times its variants.

    The training runs go one after another, so load that drifts between them (other processes on
    a shared machine) moves their step times apart. Here every recipe gets its own model (seed 0)
    and optimizer, all alive at once, and each round steps every recipe in turn, the order rotated
    by one each round: a slow moment hits all of them alike, and the ratios can be formed per round
    (``instruments.timing.paired_ratio``). A round times ``TIMED_S`` of steps per recipe at least
    (several steps of a small model: one step of a few ms is one scheduler preemption away from
    double). A recipe that fails here is left out of the result. The global RNG state is put back
    afterwards: the timing does not change what runs after it. Returns seconds per step.
    """
    from mixprec.instruments.timing import interleaved_order, time_call

    rng = torch.random.get_rng_state()
    arms: dict[str, Callable[[], None]] = {}
    try:
        per_step: list[float] = []
        for recipe in recipes:
            try:
                arms[recipe.name] = _timed_step(task, recipe, device)
                for _ in range(max(0, warmup - 1)):
                    arms[recipe.name]()
                per_step.append(time_call(arms[recipe.name], device))
            except Exception:  # the training run already said what is wrong with this recipe
                arms.pop(recipe.name, None)
        repeat = max(1, min(MAX_STEPS_PER_ROUND, math.ceil(TIMED_S / max(min(per_step, default=TIMED_S), 1e-6))))
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for _, name in interleaved_order(list(arms), rounds):
            if name in arms:
                try:
                    samples[name].append(time_call(arms[name], device, repeat))
                except Exception:
                    del arms[name]
                    samples.pop(name)
        return {name: t for name, t in samples.items() if len(t) == rounds}
    finally:
        torch.random.set_rng_state(rng)


def _timed_step(task: Task, recipe: Recipe, device: torch.device) -> Callable[[], None]:
    mp = MixedPrecision(recipe, device)
    model = mp.prepare(_build_model(task, REFERENCE_SEED, device))
    optimizer = task.build_optimizer(mp.parameters(model))
    state = {"step": 0}

    def step() -> None:
        inputs, targets = _call_get_batch(task, state["step"] % max(1, task.steps))
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        with mp.autocast():
            outputs = task.run_forward(model, inputs)
        mp.step(task.loss_fn(outputs, targets), optimizer, max_grad_norm=task.max_grad_norm)
        state["step"] += 1

    return step


REFERENCE_SEED = 0  # (as comparison.api's: the timing models start where the seed-0 runs started)
TIMED_S = 0.05  # seconds of steps per recipe and round, at least
MAX_STEPS_PER_ROUND = 20


def _mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    loss = loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def shard_batch(batch: Any, task: Task) -> Any:
    """This rank's slice (dimension 0) of every tensor in a batch; refuses a batch that does not split."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % world:
            raise TaskError(f"task {task.name!r}: a batch of {tuple(batch.shape)} does not split over {world} ranks "
                            "along dimension 0; use a batch size that is a multiple of the number of processes")
        return batch.chunk(world)[rank]
    if isinstance(batch, dict):
        return {k: shard_batch(v, task) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard_batch(v, task) for v in batch)
    return batch
