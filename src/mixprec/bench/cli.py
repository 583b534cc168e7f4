"""``mixprec bench``: what each recipe buys on this machine, and what mixprec's step costs."""

from __future__ import annotations

import argparse

HELP = "time the reference transformer block under every recipe (or mixprec's step against a hand-written loop)"
DESCRIPTION = """\
Time one pre-LN transformer block (forward, backward, AdamW step, clipping) under every recipe,
interleaved, and report per recipe: median step time, speedup over fp32, tokens/s, achieved FLOP/s
and the fraction of a matmul peak measured in the same run, activation memory, and host syncs per
step on CUDA. With --overhead, time MixedPrecision.step against the same loop written by hand with
torch.autocast + torch.amp.GradScaler instead, and print the ratio.

Shapes: ref (d=1024, B=32, T=512; the seeds' shape, for GPUs), cpu (d=256, B=4, T=128), small,
tiny. CPU numbers on a shared machine are noisy: read the IQR column.

examples:
  mixprec bench                                   # cpu shape on CPU, ref shape on CUDA
  mixprec bench --shape tiny --reps 3 --json out.json
  mixprec bench --device cuda --compile both --recipes fp32 bf16-mixed
  mixprec bench --overhead --recipes fp32 fp16-mixed --reps 60
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=None, help="ref, cpu, small or tiny (default: ref on CUDA, cpu on CPU; small with --overhead)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--recipes", nargs="+", default=None, metavar="NAME",
                        help="recipes to run (default: every registered recipe; with --overhead: fp32 and fp16-mixed)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 10; 50 with --overhead)")
    parser.add_argument("--steps-per-rep", type=int, default=1, help="training steps timed together per round")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 2; 3 with --compile)")
    parser.add_argument("--compile", nargs="?", const="both", default="off", choices=("off", "on", "both"),
                        help="run torch.compile'd variants ('--compile' alone: eager and compiled)")
    parser.add_argument("--tf32", default="both", choices=("off", "on", "both"),
                        help="TF32 for fp32 matmuls on CUDA; 'both' runs fp32 recipes twice (default)")
    parser.add_argument("--optimizer", nargs="+", default=None, choices=("foreach", "fused", "forloop"),
                        help="AdamW implementation (default: fused on CUDA, foreach on CPU); several with --overhead")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is steadier on a busy machine")
    parser.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: no clipping; default 1.0)")
    parser.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    parser.add_argument("--no-memory", action="store_true", help="skip the activation/peak memory pass")
    parser.add_argument("--overhead", action="store_true", help="time MixedPrecision.step against the hand-written torch.amp loop")
    parser.add_argument("--plain", action="store_true", help="with --overhead: also time the hand loop on an unprepared model")
    parser.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                        help="bound the run: warm-ups (compilation included) may take 60%%, variants past that are "
                             "skipped, and the timed rounds stop early (at least 3) to finish in time")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full results (every sample) as JSON")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")


def _check(args: argparse.Namespace) -> str | None:
    for name in ("reps", "steps_per_rep", "warmup", "threads"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            return f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {value}"
    if args.budget_s is not None and not args.budget_s > 0:  # (NaN too: it compares false to every time)
        return f"--budget-s must be > 0, got {args.budget_s}"
    if args.budget_s is not None and args.overhead:
        return "--budget-s applies to the recipe benchmark, not to --overhead"
    if not args.clip >= 0:  # (NaN too: every variant's step would refuse it, after the warm-ups)
        return f"--clip must be >= 0 (0 turns clipping off), got {args.clip}"
    if args.plain and not args.overhead:
        return "--plain only applies with --overhead"
    if args.optimizer and len(args.optimizer) > 1 and not args.overhead:
        return "several --optimizer values only apply with --overhead"
    if args.json is not None:  # checked now: the file is written only after the whole run
        import os
        from pathlib import Path

        target = Path(args.json)
        folder = target.parent
        if target.is_dir():
            return f"--json {args.json!r} is a directory; give a file path"
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            return f"--json {args.json!r} cannot be written: {str(folder)!r} is not a writable directory"
    return None


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from mixprec.bench import tables
    from mixprec.bench.block import get_shape
    from mixprec.recipes import as_device, resolve_recipe
    from mixprec.report.terminal import make_console

    console = make_console(log_path=False)
    try:
        device = as_device(args.device)
        if device.type == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {args.device!r} asked for, but CUDA is not available here; use --device cpu")
        shape = get_shape(args.shape or ("ref" if device.type == "cuda" else "small" if args.overhead else "cpu"))
        for r in args.recipes or ():
            recipe = resolve_recipe(r, device)
            if args.overhead and recipe.stores_16bit:
                raise ValueError(
                    f"--overhead times mixprec's step against the same loop written by hand with torch.amp "
                    f"(autocast + GradScaler), which has no master weights: {recipe.name!r} stores weights in "
                    "16 bits and has no hand-written twin. Time it with 'mixprec bench --recipes "
                    f"{recipe.name}' (against fp32 and the other recipes), or give --overhead a -mixed recipe"
                )
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    clip = args.clip or None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = lambda msg: console.log(msg)  # noqa: E731
    from mixprec.instruments.machine import describe, environment

    console.print(f"machine: {describe(environment(device))}", highlight=False)  # every number names its machine

    if args.overhead:
        from mixprec.bench.overhead import run_overhead_suite
        from mixprec.bench.runner import default_optimizer

        doc = run_overhead_suite(
            shape, device, args.recipes or ["fp32", "fp16-mixed"], args.optimizer or [default_optimizer(device)],
            rounds=args.reps or 50, warmup=3 if args.warmup is None else args.warmup, clip=clip,
            arms=("mixprec", "hand", "hand-plain") if args.plain else ("mixprec", "hand"), log=log,
        )
        headers, rows = tables.overhead_rows(doc)
        tables.print_table(console, f"MixedPrecision.step vs the hand-written torch.amp loop, shape {shape.describe()}",
                           headers, rows, keep=2, legend=tables.OVERHEAD_LEGEND)
    else:
        from mixprec.bench.runner import plan_variants, run_bench

        try:
            variants = plan_variants(args.recipes, device, args.tf32, args.compile)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        warmup = args.warmup if args.warmup is not None else (3 if args.compile != "off" else 2)
        doc = run_bench(shape, device, variants, rounds=args.reps or 10, steps_per_round=args.steps_per_rep,
                        warmup=warmup, optimizer=(args.optimizer or [None])[0], clip=clip,
                        peaks=not args.no_peak, peak_n=256 if shape.name == "tiny" else None, memory=not args.no_memory,
                        budget_s=args.budget_s, log=log)
        headers, rows = tables.bench_rows(doc)
        tables.print_table(console, f"reference block on {doc['env']['device_name']} ({device})", headers, rows,
                           legend=tables.BENCH_LEGEND)
        if doc["peaks"]:
            tables.print_table(console, "measured matmul peaks", *tables.peak_rows(doc))
        for line in tables.roofline_lines(doc):
            console.print(line, highlight=False)
        settings = doc["settings"]
        if settings["budget_s"] is not None and settings["rounds_run"] < settings["rounds"]:
            console.print(f"time budget: {settings['rounds_run']} of {settings['rounds']} rounds ran", highlight=False)
    if args.markdown:
        print(tables.markdown_table(headers, rows))
    if args.json:
        write_file(args.json, json.dumps(doc, indent=1))
        console.print(f"wrote {args.json}")
    for line in tables.errors_of(doc):
        console.print(f"error: {line}", style="red", highlight=False)
    errors = [r for r in doc.get("results", doc.get("runs", [])) if r["status"] == "error"]
    return 1 if errors else 0



def write_file(path: str, text: str) -> None:
    """``text`` written aside and renamed over ``path`` (``mixprec.report.publish``): a Ctrl-C, a full disk or
    a write error part-way leaves the earlier file whole (or none), never a torn one."""
    from pathlib import Path

    from mixprec.report.publish import publish_file

    publish_file(Path(path), text)
