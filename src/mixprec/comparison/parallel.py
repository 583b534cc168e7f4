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
import os
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


def machine_ranks(device: torch.device) -> tuple[int, str]:
    """How many local ranks this machine runs at once on ``device``'s backend, and of what."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "CUDA devices (nccl: one per rank)"
    try:
        return len(os.sched_getaffinity(0)), "CPUs (gloo)"
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1, "CPUs (gloo)"


def check_options(nproc: int, parallel: str | None, *, backend: str = "torch", device: torch.device | None = None,
                  force: bool = False) -> None:
    """``compare``'s --nproc/--parallel/--backend before anything runs; raises ValueError saying
    what to change. ``parallel`` None: not given. ``force``: more CPU ranks than CPUs."""
    if force and nproc == 1:  # (accepted and ignored before)
        raise ValueError("--force-nproc lets --nproc N start more processes than this machine has CPUs; without "
                         "--nproc (N > 1) every run trains on one process. Add --nproc N, or drop --force-nproc")
    if backend == "jax":
        if nproc != 1 or parallel is not None:
            given = " ".join(x for x in (f"--nproc {nproc}" if nproc != 1 else "",
                                         f"--parallel {parallel}" if parallel else "") if x)
            raise ValueError(f"{given} trains torch runs on several processes; --backend jax has no data-parallel "
                             "runs (mixprec.jax trains on one process). Drop it, or use --backend torch")
        return
    if parallel is not None and nproc == 1:
        raise ValueError(f"--parallel {parallel} applies to data-parallel runs on several processes (--nproc N, N > 1); "
                         f"without --nproc every run trains on one process. Add --nproc 2 (or more), or drop --parallel")
    if nproc == 1:
        return
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    have, what = machine_ranks(dev)
    if dev.type == "cuda" and have == 0:
        return  # (the device check says that CUDA is not available, in the words it uses everywhere)
    if dev.type == "cuda" and nproc > have:
        raise ValueError(f"--nproc {nproc}: this machine has {have} {what}; use --nproc {max(have, 1)} or fewer, or "
                         "--device cpu")
    if nproc > have and not force:
        raise ValueError(f"--nproc {nproc}: this machine has {have} {what}, so {nproc} ranks would only share them "
                         f"(and start {nproc} processes). Use --nproc {have} or fewer, or pass --force-nproc "
                         "(compare(force_nproc=True)) to start them anyway")


def check_recipes(plan: list[tuple[Recipe, int, str]], parallel: str) -> None:
    """Every recipe of the plan can run under ``parallel``: said before any rank starts."""
    if parallel != "fsdp":
        return
    from mixprec.distributed.fsdp import unsupported

    for recipe, _, _ in plan:
        why = unsupported(recipe)
        if why:
            raise ValueError(f"--parallel fsdp: {why}")


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
    check_recipes(plan, parallel)
    failures: list[str] = []
    spec = {"task": task, "task_kwargs": task_kwargs, "plan": _names(plan, device), "steps": steps,
            "device": str(device), "parallel": parallel, "threads": threads}

    def on_line(text: str) -> None:
        for piece in text.split(TAG):  # (two ranks' lines may share one line of the launcher's output)
            try:
                msg = json.JSONDecoder().raw_decode(piece.strip())[0]
            except ValueError:
                continue
            if isinstance(msg, dict) and "kind" in msg:
                handle(msg)

    def handle(msg: dict[str, Any]) -> None:
        if msg["kind"] == "run" and on_run is not None:
            on_run(msg["label"], msg["index"], msg["total"])
        elif msg["kind"] == "step" and progress is not None:
            progress(msg["label"], msg["done"], msg["total"], torch.tensor(msg["loss"]))
        elif msg["kind"] == "error":
            failures.append(f"rank {msg['rank']} failed: {msg['error']}")

    with tempfile.TemporaryDirectory(prefix="mixprec-compare-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "runs.pkl"
        try:
            spec_path.write_text(json.dumps(spec))
        except TypeError as e:
            raise TaskError(f"--nproc sends the task's arguments to the processes as JSON: {e}") from None
        try:
            launch("mixprec.comparison.parallel", [str(spec_path), str(out_path)], nproc, tag=TAG, on_line=on_line,
                   timeout=timeout)
        except LaunchError as e:  # a rank's own error first; the launcher's output after it
            failures.sort(key=_is_consequence)  # (the others' broken collectives after the error that broke them)
            first = "\n".join(failures) + "\n(the launcher's output follows)\n" if failures else ""
            raise RuntimeError(f"compare --nproc {nproc}: {first}{e}") from None
        with open(out_path, "rb") as f:
            return pickle.load(f)  # written by rank 0 of this launch, a moment ago


# what a rank raises when another rank stopped in the middle of a collective: a consequence, not the cause
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
                 "another rank may have stopped", "DesyncError")


def _is_consequence(failure: str) -> bool:
    return any(c in failure for c in _CONSEQUENCES)


def main(argv: list[str] | None = None) -> int:
    """One rank (under torchrun)."""
    try:
        return _main(argv)
    except Exception as e:  # said in one tagged line the parent prints before the launcher's output
        print(f"{TAG} " + json.dumps({"kind": "error", "rank": int(os.environ.get("RANK", "0")),
                                      "error": f"{type(e).__name__}: {e}"}), flush=True)
        raise


def _main(argv: list[str] | None) -> int:
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
    code = main()
    # Leave without the interpreter's teardown: with gloo on torch 2.13, a rank whose work is done
    # and whose group is destroyed can still abort while Python finalises ("terminate called
    # without an active exception", now and then), failing a compare that finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
