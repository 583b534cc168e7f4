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
  mixprec compare --recipes all            # every recipe, the 16-bit storage and fp8 ones included
  mixprec compare --recipes baselines      # the UNSAFE baselines (bf16-pure, fp16-pure, fp8-unscaled): they fail by design
  mixprec compare --task examples.compare_custom_task:make_task
  mixprec compare --task-arg d_model=64 --task-arg n_layer=4 --device cuda
  mixprec compare --quiet && echo "mixed precision is safe here"
  mixprec compare --backend jax            # the same judgement on a built-in JAX model (pip install 'mixprec[jax]')
  mixprec compare --nproc 2                # every run data-parallel on 2 processes (torchrun; DDP, gloo on CPU)
  mixprec compare --task fragile --recipes bf16-pure --explain   # why it diverges, and a verified fix
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default=None, metavar="MODULE:FUNCTION",
                        help="task factory returning mixprec.tasks.Task (default: the built-in char GPT)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the task factory (repeatable), e.g. d_model=64")
    parser.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                        help="recipes to judge (names or jmp policy strings; commas also separate; 'all' for "
                             "every registered recipe but the unsafe baselines, 'baselines' for those); "
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
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                        help="with --nproc: DistributedDataParallel (default) or FSDP2")
    parser.add_argument("--force-nproc", action="store_true",
                        help="start --nproc N CPU processes even where N is more than this machine's CPUs (they then "
                             "share them); without it, N is bounded by the CPU count (gloo) or the GPU count (CUDA)")
    parser.add_argument("--timing-rounds", type=int, default=10, metavar="N",
                        help="after the runs, time every recipe's step in N interleaved rounds for the speed column "
                             "(default 10; 0: take it from the runs, one after another, which is indicative only)")
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch",
                        help="train with torch (default) or JAX (needs the jax extra; --task then names a JaxTask factory)")
    parser.add_argument("--explain", action="store_true",
                        help="for each recipe that does not TRACK: where the error enters (module by module against "
                             "fp32), which cause holds, and the smallest fix, verified (docs/compare.md)")
    parser.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                        help="with --explain: train N candidate runs at once, in worker processes (default 1)")
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

    try:  # options that cannot apply, and --nproc beyond this machine: refused before anything runs
        from mixprec.comparison.parallel import check_options
        from mixprec.recipes import as_device

        backend = getattr(args, "backend", "torch")
        check_options(args.nproc, args.parallel, backend=backend, force=args.force_nproc,
                      device=as_device(args.device) if args.nproc > 1 and backend == "torch" else None)
    except (ValueError, RuntimeError) as e:
        return error(str(e))
    why_not = _explain_refusal(args)
    if why_not:
        return error(why_not)
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
                nproc=args.nproc, parallel=args.parallel or "ddp", timing_rounds=getattr(args, "timing_rounds", 10),
            )
    except RunError as e:
        return error(f"{e}\n(an fp32 run failed, so nothing can be judged: debug the task in plain fp32 first)")
    except (TaskError, ValueError, FileExistsError, PermissionError, RuntimeError) as e:  # RuntimeError: a recipe this device cannot run
        if args.traceback:  # the task's own code raised (the cause): show where; else where mixprec refused
            import traceback

            traceback.print_exception(e.__cause__ if e.__cause__ is not None else e)
        return error(str(e) + ("" if args.traceback or e.__cause__ is None else " (run with --traceback for the full traceback)"))
    except Exception as e:  # e.g. an exception raised while importing the task's module
        if args.traceback:
            raise
        given = ", ".join(f"{k}={v!r} ({type(v).__name__})" for k, v in task_kwargs.items())
        return error(f"{type(e).__name__}: {e}" + (f" (the task's arguments: {given})" if given else "")
                     + " (run with --traceback for the full traceback)")

    explaining = getattr(args, "explain", False)
    if args.json:  # with --explain: one JSON, the explanations in it, printed after them
        if not explaining:
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
    if explaining:
        return _run_explain(args, result, task_kwargs, threads, None if args.quiet else err, error)
    return 0 if result.ok else 1



def _explain_refusal(args: argparse.Namespace) -> str | None:
    """Why --explain / --jobs cannot run with the other options given (None: they can)."""
    explain, jobs = getattr(args, "explain", False), getattr(args, "jobs", None)
    if jobs is not None and not explain:
        return "--jobs sets how many --explain candidate runs train at once; add --explain (compare runs one at a time)"
    if explain and getattr(args, "backend", "torch") == "jax":
        return "--explain runs on the torch backend only (it hooks torch modules); drop --backend jax"
    if explain and getattr(args, "nproc", 1) > 1:
        return ("--explain trains its candidates one process each and judges them against the comparison's band; with "
                "--nproc the comparison's runs are data-parallel and the two would not compare: drop --nproc")
    return None


def _run_explain(args: argparse.Namespace, result, task_kwargs, threads, err, error) -> int:
    """After the comparison: explain every recipe that does not TRACK, reusing its runs (one report
    directory each, beside compare's files)."""
    import json
    import re
    from pathlib import Path

    from mixprec.comparison.explain.api import explain

    explained = {}
    for name, verdict in result.verdicts.items():
        if verdict.ok:
            continue
        out = None if not result.files else str(Path(result.files["json"]).parent / ("explain-" + re.sub(r"[^\w.-]+", "_", name)))
        say = (lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)) if err is not None else None
        try:
            e = explain(args.task, name, comparison=result, device=args.device, out=out, task_kwargs=task_kwargs,
                        threads=threads, jobs=args.jobs or 1, progress=say)
        except Exception as ex:  # the comparison stands; the explanation could not be made
            if args.traceback:
                raise
            return error(f"--explain {name}: {type(ex).__name__}: {ex}")
        explained[name] = e
        if args.json:
            continue
        if args.quiet:
            print(f"{name}: explain: {e.status}: {e.summary}" + (f"\n  fix: {e.fix.code}" if e.fix else ""))
        else:
            print(e.render_text())
        if e.files:
            print(f"explain report: {e.files['html']}")
    if args.json:
        print(json.dumps({**result.to_dict(), "explain": {n: e.to_dict() for n, e in explained.items()}},
                         indent=2, allow_nan=False))
    elif not explained:
        print("every recipe TRACKS: nothing to explain")
    return 0 if result.ok else 1
