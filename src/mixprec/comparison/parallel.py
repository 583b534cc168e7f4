"""``mixprec compare --nproc N``: every run of the comparison trained data-parallel on N local processes.

The parent (``run_plan_on_ranks``) starts this module's ``main`` on N ranks through torch's
launcher (``mixprec.distributed.launch``) once for the whole plan; every rank builds the task,
and ``api.run_plan`` trains each run with ``parallel=`` (each rank on its slice of every batch, the
loss recorded as the mean over the ranks). Rank 0 writes the runs to a file the parent reads, and
prints progress lines the parent hands to the progress display. The parent judges the runs
exactly as a one-process comparison does.

    python -m mixprec.comparison.parallel SPEC.json OUT.pkl      (on every rank, under torchrun)
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixprec.recipes import Recipe, resolve_recipe
from mixprec.tasks import Task, TaskError

TAG = "MIXPREC-COMPARE"


def _names(plan: list[tuple[Recipe, int, str]], device: torch.device) -> list[tuple[str, int, str]]:
    out = []
    for recipe, seed, role in plan:
        try:
            same = resolve_recipe(recipe.name, device) == recipe
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"recipe {recipe.name!r} is not registered (or differs from the registered one): the "
                             "processes of --nproc find recipes by name; register_recipe() it in the task's module")
        out.append((recipe.name, seed, role))
    return out


def run_plan_on_ranks(task: Any, task_kwargs: dict[str, Any], plan: list[tuple[Recipe, int, str]], steps: int,
                      device: torch.device, nproc: int, parallel: str, threads: int | None, *,
                      progress: Callable[..., None] | None = None, on_run: Callable[[str, int, int], None] | None = None,
                      timeout: float | None = None) -> list[Any]:
    """Train ``plan`` on ``nproc`` ranks (see the module docstring); returns the runs (``RunResult``)."""
    from mixprec.distributed.launch import LaunchError, launch

    if task is not None and not isinstance(task, str):
        raise TaskError("--nproc starts new processes, which import the task: give it as 'module:function' (or a "
                        f"built-in name), not a {type(task).__name__}")
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {parallel!r}")
    spec = {"task": task, "task_kwargs": task_kwargs, "plan": _names(plan, device), "steps": steps,
            "device": str(device), "parallel": parallel, "threads": threads}

    def on_line(text: str) -> None:
        msg = json.loads(text)
        if msg["kind"] == "run" and on_run is not None:
            on_run(msg["label"], msg["index"], msg["total"])
        elif msg["kind"] == "step" and progress is not None:
            progress(msg["label"], msg["done"], msg["total"], torch.tensor(msg["loss"]))

    with tempfile.TemporaryDirectory(prefix="mixprec-compare-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "runs.pkl"
        try:
            spec_path.write_text(json.dumps(spec))
        except TypeError as e:
            raise TaskError(f"--nproc sends the task's arguments to the processes as JSON: {e}") from None
        try:
            launch("mixprec.comparison.parallel", [str(spec_path), str(out_path)], nproc, tag=TAG, on_line=on_line,
                   timeout=timeout)
        except LaunchError as e:
            raise RuntimeError(f"compare --nproc {nproc}: {e}") from None
        with open(out_path, "rb") as f:
            return pickle.load(f)  # written by rank 0 of this launch, a moment ago


def main(argv: list[str] | None = None) -> int:
    """One rank (under torchrun)."""
    from mixprec.comparison.runner import run_plan
    from mixprec.distributed.launch import emit, init_from_env
    from mixprec.tasks import load_task

    spec_path, out_path = argv if argv is not None else sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    rank, _, dev = init_from_env(spec["device"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    task: Task = load_task(spec["task"], **spec["task_kwargs"])
    plan = [(resolve_recipe(name, dev), seed, role) for name, seed, role in spec["plan"]]
    every = max(1, spec["steps"] // 20)

    def on_run(label: str, index: int, total: int) -> None:
        emit(TAG, {"kind": "run", "label": label, "index": index, "total": total})

    def progress(label: str, done: int, total: int, loss: torch.Tensor) -> None:
        if done % every == 0 or done == total:
            emit(TAG, {"kind": "step", "label": label, "done": done, "total": total, "loss": float(loss)})

    runs = run_plan(task, plan, spec["steps"], dev, progress=progress, on_run=on_run, parallel=spec["parallel"])
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(runs, f)
    import torch.distributed as dist

    dist.barrier()  # every rank done with its collectives before the group is torn down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
