"""``mixprec doctor``: the mixed-precision debugging checklist on your model, with a report."""

from __future__ import annotations

import argparse

HELP = "run the mixed-precision debugging checklist on a model and say where it breaks"
DESCRIPTION = """\
Train a few steps of a task under a recipe inside a NaN guard, the same step in fp32 (and bf16
when the recipe's step fails), probe gradient underflow, update vanishing and activation range,
and go through the debugging checklist: fp32 too? loss in fp32? unscale before clipping? log(0),
division by zero, sqrt of a negative? a 16-bit normalisation with tiny variance? does bf16 fix it?
Each finding names the module and op, shows the evidence and gives the fix. Writes doctor.html
(with the gradient histogram against fp16/bf16/fp8 ranges), doctor.json and PNGs into --out.

A task is 'package.module:function' returning a mixprec.tasks.Task (model, batches, loss); the
default is the built-in character-level GPT.

exit status: 0 nothing alarming, 1 alarming findings, 2 the task or options could not be used.

examples:
  mixprec doctor
  mixprec doctor --task mypkg.tasks:make_task --recipe fp16-mixed --out doctor-report
  mixprec doctor --task-arg d_model=64 --task-arg n_layer=4 --recipe bf16-true
  mixprec doctor --task tests.diagnostics.zoo:make_log_zero --json
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default=None, metavar="MODULE:FN",
                        help="task factory (default: the built-in char-level GPT)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the task factory (repeatable), e.g. d_model=64")
    parser.add_argument("--recipe", default="fp16-mixed",
                        help="recipe to examine (default fp16-mixed; any name from 'mixprec recipes' or a jmp policy)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=3, help="steps under the recipe (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="model seed (default 0)")
    parser.add_argument("--out", default="mixprec-report", metavar="DIR",
                        help="write doctor.html, doctor.json and figures here (default mixprec-report); '' for none")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    import traceback

    from rich.console import Console
    from rich.markup import escape

    from mixprec.diagnostics.doctor import doctor
    from mixprec.diagnostics.doctor_report import check_out_dir
    from mixprec.report.terminal import make_console
    from mixprec.tasks import TaskError

    from mixprec.arguments import parse_task_args

    err = Console(stderr=True)
    progress = None if args.json else (lambda msg: err.print(f"[dim]... {msg}[/dim]"))
    try:
        if args.out:
            check_out_dir(args.out)  # before the runs: a bad --out should not cost them
        task_kwargs = parse_task_args(args.task_arg)
        report = doctor(args.task, args.recipe, args.device, steps=args.steps, seed=args.seed, progress=progress,
                        task_kwargs=task_kwargs)
    except (TaskError, ValueError, RuntimeError, FileExistsError, PermissionError) as e:
        message, cause = str(e), e.__cause__
        # mixprec.tasks' messages point at compare's help, which compare shares; here doctor's says the same
        message = message.replace("'mixprec compare --help'", "'mixprec doctor --help'")
        if isinstance(e, TaskError) and cause is not None and cause.__traceback__ is not None:  # the factory's own code
            frame = traceback.extract_tb(cause.__traceback__)[-1]
            message += f" (raised at {frame.filename}:{frame.lineno} in {frame.name})"
        err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # a path or recipe may hold '[...]': not markup
        return 2
    except Exception as e:  # the task's own code raised (importing its module, its factory): not a finding
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = "" if isinstance(e, SyntaxError) else f" (raised at {frame.filename}:{frame.lineno} in {frame.name})"
        err.print(f"error: {type(e).__name__}: {e}{where}", markup=False, highlight=False, soft_wrap=True)
        return 2
    try:
        written = report.write(args.out) if args.out else {}
        write_error = None
    except OSError as e:  # checked before the runs, so something changed since: still show the findings
        written, write_error = {}, f"the report could not be written to {args.out!r}: {e}"
    if args.json:
        print(report.to_json())
    else:
        from mixprec.diagnostics.doctor_report import renderables

        console = make_console()
        for r in renderables(report):
            console.print(r)
        if "doctor.html" in written:
            console.print(f"report: {written['doctor.html']}")
    if write_error:
        err.print(f"error: {write_error}", markup=False, highlight=False, soft_wrap=True)
        return 2
    return report.exit_code
