"""``mixprec memory``: what a recipe and an optimizer cost in bytes, planned and (optionally) measured."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

HELP = "plan (and measure) the memory of weights, grads, masters, optimizer state and activations"
DESCRIPTION = """\
For a parameter count (or a model) and one or more recipes, print the bytes of weights,
gradients, master weights, optimizer state, autocast's weight copies, activations (given a
transformer shape) and the fp32 memory alive only during the optimizer step; then the
persistent total and the peak. Sizes are decimal (1 GB = 1e9 bytes).

examples:
  mixprec memory --params 7e9 --recipe bf16-mixed --optimizer adamw
  mixprec memory --params 7B --recipe fp32,bf16-mixed,bf16-true,bf16-true-sr
  mixprec memory --params 7B --recipe bf16-true --batch 1 --seq 4096 --d-model 4096 --layers 32 --heads 32 --vocab 32000
  mixprec memory --params 7B --trainable 40M --recipe bf16-mixed,bf16-true   # a frozen base (LoRA)
  mixprec memory --params 7B --recipe bf16-mixed,bf16-true-sr --accumulate 8   # gradient accumulation
  mixprec memory --model mypkg.models:make_model --recipe all
  mixprec memory --params 70B --recipe bf16-mixed,bf16-true --world-size 64 --parallel fsdp   # per rank
  mixprec memory --measure --recipe bf16-mixed,bf16-true --batch 16 --seq 64 --d-model 64 --layers 2 --heads 4 --vocab 96
"""

_SHAPE = ("batch", "seq", "d_model", "layers", "heads")


def configure(parser: argparse.ArgumentParser) -> None:
    # "--params -7B" must reach parse_count (which says what is wrong) instead of argparse taking
    # "-7B" for an option: no option of this command starts with a digit, so such tokens are values
    parser._negative_number_matcher = re.compile(r"^-\d")  # (argparse's own hook for negative numbers)
    src = parser.add_argument_group("what to plan for")
    src.add_argument("--params", help="parameter count: 7e9, 7B, 125M, 1000")
    src.add_argument("--trainable", metavar="COUNT",
                     help="with --params: how many of them train (the rest are frozen: no gradients, optimizer "
                          "state or masters), e.g. a LoRA fine-tune: --params 7B --trainable 40M")
    src.add_argument("--model", metavar="MODULE:FUNCTION",
                     help="a factory returning an nn.Module (counted exactly, fp32 rule applied) or a mixprec Task")
    src.add_argument("--recipe", default="fp32,bf16-mixed,bf16-true",
                     help="recipe names, comma separated (a jmp policy string such as p=f32,c=bf16,o=f32 counts as one), "
                          "or 'all' (default: fp32,bf16-mixed,bf16-true)")
    src.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd-momentum, adagrad, rmsprop")
    src.add_argument("--accumulate", type=int, default=1, metavar="K",
                     help="gradient accumulation over K micro-batches (16-bit storage recipes then keep fp32 "
                          "accumulators through each window; default 1)")
    par = parser.add_argument_group("data parallel (per rank; the activation shape is per rank too)")
    par.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks training together (default 1)")
    par.add_argument("--parallel", choices=("fsdp", "ddp"), default=None,
                     help="fsdp: weights, gradients, optimizer state and masters sharded over the ranks (FSDP2); "
                          "ddp: every rank holds all of it")
    act = parser.add_argument_group("activations of a GPT-style transformer (all five, or none)")
    act.add_argument("--batch", type=int, metavar="N", help="sequences per step (per micro-batch, per rank)")
    act.add_argument("--seq", type=int, metavar="N", help="tokens per sequence")
    act.add_argument("--d-model", type=int, metavar="N", help="hidden size (a multiple of --heads)")
    act.add_argument("--layers", type=int, metavar="N", help="transformer blocks")
    act.add_argument("--heads", type=int, metavar="N", help="attention heads")
    act.add_argument("--vocab", type=int, default=0, help="vocabulary size: adds the fp32 log-probabilities")
    act.add_argument("--attention", choices=("eager", "flash"), default=None,
                     help="eager (the default) keeps heads*seq^2 softmax probabilities per sequence; flash does not")
    meas = parser.add_argument_group("measurement")
    meas.add_argument("--measure", action="store_true",
                      help="run one real step of the task (--model, or the built-in char GPT) and show measured bytes")
    meas.add_argument("--device", default="cpu",
                      help="device to plan for and to --measure on (default cpu); on cuda, autocast runs softmax in "
                           "fp32, which changes the eager-attention activations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _load(spec: str) -> Any:
    """Build what ``--model`` names; an error in the user's module or factory is one line."""
    import traceback

    from mixprec.tasks import TaskError, import_factory

    try:
        return import_factory(spec)()
    except TaskError:
        raise
    except Exception as e:  # importing the module or calling the factory raised
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = "" if isinstance(e, SyntaxError) else f" (at {frame.filename}:{frame.lineno} in {frame.name})"
        raise TaskError(f"{spec}: {type(e).__name__}: {e}{where}") from e


def _builtin_task(shape, load_task):
    """The built-in char GPT for --measure, built with the shape the plan uses (or its defaults)."""
    import inspect

    from mixprec.memory import TransformerShape
    from mixprec.tasks import charlm

    if shape is None:
        d = {k: v.default for k, v in inspect.signature(charlm.make_task).parameters.items()}
        shape = TransformerShape(d["batch_size"], d["seq_len"], d["d_model"], d["n_layer"], d["n_head"], len(charlm.VOCAB))
    elif shape.vocab not in (0, len(charlm.VOCAB)):
        raise ValueError(f"the built-in task has a vocabulary of {len(charlm.VOCAB)}; drop --vocab or pass --vocab {len(charlm.VOCAB)}")
    task = load_task(None, batch_size=shape.batch, seq_len=shape.seq, d_model=shape.d_model,
                     n_layer=shape.layers, n_head=shape.heads)
    if shape.vocab == 0:
        shape = TransformerShape(shape.batch, shape.seq, shape.d_model, shape.layers, shape.heads,
                                 len(charlm.VOCAB), shape.attention)
    return task, shape


def _builtin_facts(args: argparse.Namespace) -> list[Any] | None:
    """The storage facts of the recipes asked for, from the shipped table, when the plan needs no
    model (a bare ``--params`` count) and every recipe is a built-in one: then the command is
    arithmetic and never imports torch. None otherwise (``auto``, a jmp policy string, a typo,
    ``--model``, ``--measure``): the full path resolves the recipes and says what is wrong."""
    if args.params is None or args.model is not None or args.measure:
        return None
    from mixprec.arguments import split_names
    from mixprec.memory import StorageFacts, recipe_facts

    device_type = args.device.split(":")[0]
    names = list(recipe_facts.ORDER) if args.recipe == "all" else split_names(args.recipe)
    canonical = [recipe_facts.NAMES.get(n.strip().lower()) for n in names]
    if not canonical or None in canonical or device_type not in ("cpu", "cuda"):
        return None
    return [StorageFacts(**recipe_facts.FACTS[(name, device_type)]) for name in canonical]


def _fsdp_refusals(args: argparse.Namespace, recipes: list[Any]) -> dict[str, str]:
    """Under --parallel fsdp, the recipes prepare(parallel="fsdp") refuses -> why. A recipe named
    is an error (no plan for what cannot run); under --recipe all they are left out, and said."""
    if args.parallel != "fsdp":
        return {}
    if recipes and not hasattr(recipes[0], "fsdp_refused"):  # Recipe objects: their facts say it
        from mixprec.memory import facts_from_recipe

        recipes = [facts_from_recipe(r, args.device.split(":")[0]) for r in recipes]
    refused = {f.name: f.fsdp_refused for f in recipes if f.fsdp_refused}
    if refused and args.recipe != "all":
        name, why = next(iter(refused.items()))
        raise ValueError(f"--parallel fsdp with recipe {name!r}: prepare(parallel='fsdp') refuses it, so there is no "
                         f"per-rank plan to make: {why}")
    if refused:
        print(f"note: not planned under --parallel fsdp (prepare(parallel='fsdp') refuses them): "
              f"{', '.join(refused)}", file=sys.stderr)
    return refused


class _NoTaskError(Exception):
    """Stands for mixprec.tasks.TaskError where the tasks (and torch) were not imported."""


def run(args: argparse.Namespace) -> int:
    import json

    from mixprec.arguments import split_names
    from mixprec.memory import COMPONENTS, ParamCounts, TransformerShape, optimizer_state_bytes, parse_count, plan

    facts = _builtin_facts(args)
    if facts is None:
        import torch

        from mixprec.recipes import as_device, check_device_can_run, list_recipes, resolve_recipe
        from mixprec.tasks import Task, TaskError, load_task
    else:
        TaskError = _NoTaskError  # noqa: N806 - nothing on this path raises a task error

    try:
        if args.recipe != "all" and not split_names(args.recipe):
            raise ValueError(f"--recipe {args.recipe!r} names no recipe; give names such as bf16-mixed,bf16-true, "
                             "or all")
        from mixprec._env import workspace_mode

        workspace_mode()  # a bad MIXPREC_MASTER_WORKSPACE is said here, in one line
        if facts is None:
            names = [r.name for r in list_recipes()] if args.recipe == "all" else split_names(args.recipe)
            recipes = [resolve_recipe(n, "cpu") for n in names]
        given = [getattr(args, f) is not None for f in _SHAPE]
        if any(given) and not all(given):
            missing = [f"--{f.replace('_', '-')}" for f, g in zip(_SHAPE, given) if not g]
            raise ValueError(f"the activation estimate needs all of --batch --seq --d-model --layers --heads; missing {' '.join(missing)}")
        if args.vocab and not all(given):
            raise ValueError(f"--vocab {args.vocab} is part of the activation estimate: give it with --batch --seq "
                             "--d-model --layers --heads, or drop it")
        if args.attention is not None and not all(given):
            raise ValueError(f"--attention {args.attention} is part of the activation estimate: give it with --batch "
                             "--seq --d-model --layers --heads, or drop it")
        shape = TransformerShape(args.batch, args.seq, args.d_model, args.layers, args.heads, args.vocab,
                                 args.attention or "eager") if all(given) else None
        if args.params is not None and args.model is not None:
            raise ValueError("give --params or --model, not both")
        if args.params is not None:
            parse_count(args.params, minimum=1)  # a bad count is an error now, not a traceback later
            if args.measure:
                raise ValueError("--measure runs a real step on a model: give --model (a Task factory) or "
                                 "nothing (the built-in task), not --params")
        optimizer_state_bytes(args.optimizer)  # names the known optimizers when it is not one
        if args.accumulate < 1:
            raise ValueError(f"--accumulate must be >= 1, got {args.accumulate}")
        if (args.world_size > 1) != (args.parallel is not None) or args.world_size < 1:
            raise ValueError("per rank needs both --world-size N (N > 1) and --parallel fsdp|ddp; "
                             f"got --world-size {args.world_size} and --parallel {args.parallel}")
        skipped = _fsdp_refusals(args, facts if facts is not None else recipes)
        if facts is not None:
            facts = [f for f in facts if f.name not in skipped]
        else:
            recipes = [r for r in recipes if r.name not in skipped]
        if args.measure and args.parallel:
            raise ValueError("--measure runs one process; the per-rank plan is checked against a measured 2-rank run "
                             "by the tests (mixprec.memory.measure.measure_parallel_step, on every rank under torchrun)")
        if args.measure and args.accumulate != 1:
            raise ValueError("--measure runs one step of accumulate=1; drop --accumulate or --measure")
        device_type = args.device.split(":")[0]
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"--device {args.device!r}: mixprec plans for cpu or cuda")
        if args.measure:  # cuda where there is none: say so before building anything
            for recipe in recipes:
                check_device_can_run(recipe, as_device(args.device))
        task = model = None
        if facts is not None:
            pass  # a bare count: no model to build
        elif args.model is not None:
            built = _load(args.model)
            task, model = (built, None) if isinstance(built, Task) else (None, built)
            if model is not None and not isinstance(model, torch.nn.Module):
                raise TaskError(f"{args.model} returned {type(model).__name__}; expected an nn.Module or a mixprec Task")
        if args.measure and task is None:
            if model is not None:
                raise ValueError("--measure needs data: give --model a factory returning a mixprec Task (see mixprec.tasks)")
            task, shape = _builtin_task(shape, load_task)
        if task is not None and model is None:
            torch.manual_seed(0)
            model = task.build_model()
        if model is None and args.params is None:
            raise ValueError("give --params N (e.g. 7e9), or --model MODULE:FUNCTION, or --measure")
        frozen = 0
        if args.trainable is not None:
            if args.params is None:
                raise ValueError("--trainable goes with --params (a --model's frozen parameters are counted from "
                                 "requires_grad)")
            total, trainable = parse_count(args.params), parse_count(args.trainable)
            if trainable > total:
                raise ValueError(f"--trainable {args.trainable} is more than --params {args.params}")
            frozen = total - trainable
    except (ValueError, RuntimeError, TaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    results = []
    if facts is not None:  # arithmetic only
        counts = ParamCounts(parse_count(args.params), frozen=frozen)
        for f in facts:
            results.append((plan(counts, f, args.optimizer, shape, args.accumulate, args.world_size, args.parallel),
                            None))
    else:
        from mixprec.memory import facts_from_recipe
        from mixprec.memory.measure import count_params, measure_step

        for recipe in recipes:
            counts = (count_params(model, recipe) if model is not None
                      else ParamCounts(parse_count(args.params), frozen=frozen))
            p = plan(counts, facts_from_recipe(recipe, args.device.split(":")[0]), args.optimizer, shape,
                     args.accumulate, args.world_size, args.parallel)
            measured = measure_step(task, recipe, args.optimizer, args.device) if args.measure else None
            results.append((p, measured))

    if args.json:
        out = [{**p.to_dict(), "measured": m.to_dict() if m else None} for p, m in results]
        print(json.dumps({"shape": shape.__dict__ if shape else None, "plans": out}, indent=2))
        return 0

    from mixprec.report.terminal import fitted_tables, make_console

    console = make_console()
    n = results[0][0].counts.total
    frozen_n = results[0][0].counts.frozen
    title = (f"memory plan: {n:,} parameters" + (f" ({n - frozen_n:,} trainable)" if frozen_n else "")
             + f", {args.optimizer}" + (f", measured on {task.name}" if args.measure else "")
             + (f", per rank of {args.world_size} ({args.parallel})" if args.parallel else ""))
    headers = ["component"]
    for p, m in results:
        headers.append(p.recipe)
        if m is not None:
            headers.append("measured")

    def cell(value: float, bold: bool = False) -> str:
        text = f"{_human(value)} ({value / n:.2f})" if n else _human(value)
        return f"[bold]{text}[/bold]" if bold else text

    rows = []
    for comp in COMPONENTS:
        row = [comp]
        for p, m in results:
            row.append(cell(p.bytes[comp]))
            if m is not None:
                row.append(cell(m.bytes[comp]))
        rows.append(row)
    for label in ("persistent", "peak"):
        row = [f"[bold]{label}[/bold]"]
        for p, m in results:
            row.append(cell(getattr(p, label), bold=True))
            if m is not None:
                if label == "persistent":
                    value = sum(m.bytes[k] for k in ("weights", "masters", "optimizer state"))
                else:
                    value = m.peak_allocated
                row.append(cell(value, bold=True) if value else "")
        rows.append(row)
    # recipes (and their measured twins) are columns: as many per table as the terminal holds
    justify = {i: "right" for i in range(1, len(headers))}
    for table in fitted_tables(headers, rows, console.width, title=title,
                               caption="cells: bytes (bytes per parameter)", justify=justify):
        console.print(table)
    for note in sorted({note for p, _ in results for note in p.notes}):
        console.print(f"  note: {note}")
    console.print("  peak = persistent + max(forward/backward: gradients (+ accumulators) + autocast copies + activations "
                  "+ the logits' gradient, "
                  "optimizer step: fp32 gradients (16-bit storage: 16-bit gradients "
                  "and one bucket of fp32 ones) and one bucket of rebuilt fp32 values)")
    if args.measure and args.device.startswith("cpu"):
        console.print("  measured on CPU: tensor storages, the peak too (counted through the dispatcher, no allocator "
                      "slack); on CUDA the peak row is max_memory_allocated")
    return 0
