"""``mixprec compare --backend jax``: the same command, options, exit codes and report, with JAX runs.

``mixprec.comparison.cli`` parses the arguments and hands them here (its one lazy import of
mixprec.jax). ``--task`` names a factory returning a ``mixprec.jax.JaxTask``; ``--threads`` does
not apply (XLA sizes its own CPU thread pool); ``--recipes all`` means every recipe mixprec.jax runs.
"""

from __future__ import annotations

import argparse
import contextlib


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mixprec.comparison.api import DEFAULT_RECIPES
    from mixprec.arguments import parse_task_args, split_recipes
    from mixprec.comparison.progress import RichProgress
    from mixprec.comparison.report import DEFAULT_OUT, print_summary
    from mixprec.comparison.runner import RunError
    from mixprec.jax.comparison import compare
    from mixprec.jax.recipes import recipe_names
    from mixprec.report.terminal import make_console
    from mixprec.tasks import TaskError

    err = Console(stderr=True)

    def error(message: str) -> int:
        err.print(f"error: {message}", markup=False, highlight=False)
        return 2

    try:
        task_kwargs = parse_task_args(args.task_arg)
    except ValueError as e:
        return error(str(e))
    if getattr(args, "nproc", 1) != 1:
        return error(f"--nproc {args.nproc} launches torch processes (torchrun); --backend jax runs in one process. "
                     "For data parallelism in JAX, shard the task's step over jax.devices() (docs/jax.md, "
                     "'Several devices'), or drop --nproc")
    if args.threads is not None:
        err.print("note: --threads applies to torch; XLA sizes its own CPU thread pool", highlight=False)
    from mixprec.jax.recipes import get_recipe

    # 'all': every recipe that computes something of its own here (a -true recipe is its -mixed twin in JAX)
    supported = [n for n in recipe_names() if n != "auto" and get_recipe(n).same_as is None]
    items = None if args.recipes is None else [
        ",".join(supported) if item.strip().lower() == "all" else item for item in args.recipes
    ]
    recipes = split_recipes(items)
    if recipes == ():
        return error("--recipes names no recipe; give names (e.g. fp32 bf16-mixed), jmp policy strings, or 'all'")
    recipes = recipes or DEFAULT_RECIPES
    for name in recipes:
        try:
            twin = get_recipe(name).same_as
        except (ValueError, TypeError):
            continue  # compare says what is wrong with it
        if twin is not None:
            err.print(f"note: {name} computes exactly like {twin} in mixprec.jax (the optimizer's fp32 pytree is the "
                      "master; the step casts it): expect the same curve", highlight=False)
    progress = None if args.quiet else RichProgress(err)
    try:
        with progress if progress is not None else contextlib.nullcontext():
            result = compare(
                args.task, recipes, steps=args.steps, seeds=args.noise_seeds, device=args.device,
                out=DEFAULT_OUT if args.out is None else (args.out or None), task_kwargs=task_kwargs,
                progress=progress.on_step if progress else None, on_run=progress.on_run if progress else None,
            )
    except RunError as e:
        return error(f"{e}\n(an fp32 run failed, so nothing can be judged: debug the task in plain fp32 first)")
    except (TaskError, ValueError, FileExistsError, PermissionError) as e:
        return error(str(e))
    except Exception as e:
        if args.traceback:
            raise
        return error(f"{type(e).__name__}: {e} (run with --traceback for the full traceback)")

    if args.json:
        print(result.to_json())
    elif args.quiet:
        for name, v in result.verdicts.items():
            print(f"{name}: {v.status}: {v.message}")
        if result.files:
            print(f"report: {result.files['html']}")
    else:
        print_summary(result, make_console())
    return 0 if result.ok else 1
