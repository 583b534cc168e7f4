"""``mixprec compare``: train a model under each recipe and fp32, judge each against fp32's noise.

Exit codes: 0 every recipe TRACKS; 1 some recipe DIVERGES, is NON-FINITE, ERROR or UNJUDGED;
2 the command could not run (bad arguments, task, recipe or output directory).
"""

from __future__ import annotations

import argparse
import contextlib

from mixprec.arguments import parse_task_args, positive_int, split_recipes  # noqa: F401  (tests and mixprec.jax use them here too)

HELP = "prove on a model that mixed precision tracks fp32 within fp32's own noise"
DESCRIPTION = """\
Train the same model from the same seed on the same batches under each recipe, and fp32 from
more seeds to measure how much fp32 differs from itself. Each recipe TRACKS fp32 (its smoothed
loss stays inside fp32's seed-to-seed band), DIVERGES (from which step, by how much) or is
NON-FINITE (first step, with the loss-scale history). Writes a report (HTML, PNG, JSON, CSV).
Without --task it trains a small built-in character-level GPT on text that ships with Python.

Your own model: --task my_pkg.my_module:make_task, a function returning mixprec.tasks.Task
(build_model, get_batch(step), loss_fn; see docs/compare.md and examples/compare_custom_task.py).

exit status: 0 all recipes track fp32; 1 some recipe does not; 2 the comparison could not run.

examples:
  mixprec compare
  mixprec compare --recipes bf16-mixed fp16-mixed --steps 300 --out my-report
  mixprec compare --recipes all            # every recipe, the 16-bit storage ones included
  mixprec compare --task examples.compare_custom_task:make_task
  mixprec compare --task-arg d_model=64 --task-arg n_layer=4 --device cuda
  mixprec compare --quiet && echo "mixed precision is safe here"
  mixprec compare --backend jax            # the same judgement on a built-in JAX model (pip install 'mixprec[jax]')
  mixprec compare --nproc 2                # every run data-parallel on 2 processes (torchrun; DDP, gloo on CPU)
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default=None, metavar="MODULE:FUNCTION",
                        help="task factory returning mixprec.tasks.Task (default: the built-in char GPT)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the task factory (repeatable), e.g. d_model=64")
    parser.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                        help="recipes to judge (names or jmp policy strings; commas also separate; 'all' for "
                             "every registered recipe); "
                             "default: fp32 bf16-mixed fp16-mixed. fp32 always runs as the reference")
    parser.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per run (default: the task's)")
    parser.add_argument("--noise-seeds", type=positive_int, default=2, metavar="N",
                        help="extra fp32 runs from other seeds that measure the noise (default 2, at least 2)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory (default: mixprec-report/compare); '' for none")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: 1 for the built-in task on CPU, whose ops are too "
                             "small to gain from more and lose 4x on a busy machine; else torch's choice)")
    parser.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="train every run data-parallel on N local processes through torchrun (each step's batch "
                             "split over them; gradients reduced in fp32); the verdict is judged the same way")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="with --nproc: DistributedDataParallel (default) or FSDP2")
    parser.add_argument("--timing-rounds", type=int, default=10, metavar="N",
                        help="after the runs, time every recipe's step in N interleaved rounds for the speed column "
                             "(default 10; 0: take it from the runs, one after another, which is indicative only)")
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch",
                        help="train with torch (default) or JAX (needs the jax extra; --task then names a JaxTask factory)")
    parser.add_argument("--quiet", action="store_true", help="no progress and no table: one line per recipe")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress goes to stderr)")
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback of unexpected errors")


def default_threads(threads: int | None, task: str | None, device: str | None) -> int | None:
    """1 for the built-in task on CPU unless asked otherwise: its ops are too small to gain from a
    second intra-op thread, and on a busy machine spinning threads made runs 4-6x slower (measured).
    Other tasks keep torch's choice (None)."""
    if threads is not None:
        return threads
    on_cpu = device is None or device.startswith("cpu")  # device None on a CUDA machine: CPU threads hardly matter
    return 1 if task is None and on_cpu else None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mixprec.comparison.api import DEFAULT_RECIPES, compare
    from mixprec.comparison.progress import RichProgress
    from mixprec.comparison.report import DEFAULT_OUT, print_summary
    from mixprec.comparison.runner import RunError
    from mixprec.report.terminal import make_console
    from mixprec.tasks import TaskError

    err = Console(stderr=True)

    def error(message: str) -> int:
        err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)  # one line: greppable
        return 2

    if getattr(args, "backend", "torch") == "jax":  # the torch side's only import of mixprec.jax, lazy
        try:
            from mixprec.jax.comparison_cli import run as run_jax
        except ImportError as e:
            return error(str(e))
        return run_jax(args)
    try:
        task_kwargs = parse_task_args(args.task_arg)
    except ValueError as e:
        return error(str(e))
    threads = default_threads(args.threads, args.task, args.device)
    recipes = split_recipes(args.recipes)
    if recipes == ():
        return error("--recipes names no recipe; give names (e.g. fp32 bf16-mixed), jmp policy strings, or 'all'")
    recipes = recipes or DEFAULT_RECIPES
    progress = None if args.quiet else RichProgress(err)
    try:
        with progress if progress is not None else contextlib.nullcontext():
            result = compare(
                args.task, recipes, steps=args.steps, seeds=args.noise_seeds, device=args.device,
                out=DEFAULT_OUT if args.out is None else (args.out or None), task_kwargs=task_kwargs, threads=threads,
                progress=progress.on_step if progress else None, on_run=progress.on_run if progress else None,
                nproc=args.nproc, parallel=args.parallel, timing_rounds=getattr(args, "timing_rounds", 10),
            )
    except RunError as e:
        return error(f"{e}\n(an fp32 run failed, so nothing can be judged: debug the task in plain fp32 first)")
    except (TaskError, ValueError, FileExistsError, PermissionError, RuntimeError) as e:  # RuntimeError: a recipe this device cannot run
        if args.traceback and e.__cause__ is not None:  # the task's own code raised: show where
            import traceback

            traceback.print_exception(e.__cause__)
        return error(str(e))
    except Exception as e:  # e.g. an exception raised while importing the task's module
        if args.traceback:
            raise
        given = ", ".join(f"{k}={v!r} ({type(v).__name__})" for k, v in task_kwargs.items())
        return error(f"{type(e).__name__}: {e}" + (f" (the task's arguments: {given})" if given else "")
                     + " (run with --traceback for the full traceback)")

    if args.json:
        print(result.to_json())
    elif args.quiet:
        for name, v in result.verdicts.items():
            print(f"{name}: {v.status}: {v.message}")
        if result.files:
            print(f"report: {result.files['html']}")
    else:
        print_summary(result, make_console())
    if result.write_error:  # the table above holds the results; the files could not be written
        return error(result.write_error + ". Rerun with another --out (the results above are what it measured).")
    return 0 if result.ok else 1

