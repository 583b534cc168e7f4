"""``mixprec infer-check``: does bf16 / fp16 inference agree with fp32 on a task's model and batches?

Exit codes: 0 every dtype agrees; 1 some dtype is degraded or broken; 2 the check could not run
(bad arguments, task, weights, or a model that fails in fp32).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from mixprec.arguments import count, parse_task_args, positive_int

HELP = "check that bf16 / fp16 inference of a model agrees with fp32 (SQNR, errors, top-1), and where it breaks"
DESCRIPTION = """\
Cast the task's fp32 model for inference in bf16 and/or fp16 (the training recipes' fp32 rules:
norms as fp32 islands; in --mode storage, the default, parameters stored in 16 bits except the
ones bf16-true/fp16-true keep fp32; in --mode autocast, fp32 parameters under autocast), run it and
the fp32 model on the same batches, and compare the outputs: SQNR (dB), max abs / relative error,
and for class scores (logits) top-1 and top-5 agreement. Each dtype gets a verdict:

  agree     SQNR >= 30 dB and top-1 >= 99% (a flip between near-tied classes aside)
  degraded  between
  broken    non-finite where fp32 is finite, SQNR < 20 dB, top-1 < 90%, or the forward fails

and, when not agree, where: the first module whose output went non-finite (and whether fp32's
output there is past fp16's 65504), or the first module whose error passes 30 dB. For fp16 it
lists modules whose fp32 outputs come within 2 bits of 65504. docs/inference.md explains the
numbers.

The model is the task's build_model() (seeded with --seed), with --weights loaded into it or
--train-steps of fp32 training first; the batches are get_batch(step) for --batches steps from
--first-batch. A task is 'package.module:function' returning a mixprec.tasks.Task, or a built-in:
charlm (the default), fragile.

exit status: 0 every dtype agrees with fp32; 1 some dtype is degraded or broken; 2 the check
could not run.

examples:
  mixprec infer-check
  mixprec infer-check --task charlm --dtype fp16 --train-steps 200
  mixprec infer-check --task mypkg.tasks:make_task --weights model.pt --batches 32 --json
  mixprec infer-check --task fragile --dtype both --mode autocast
  mixprec infer-check --task-arg d_model=64 --classes none     # compare values only, no top-1
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="charlm", metavar="MODULE:FUNCTION",
                        help="task factory returning mixprec.tasks.Task, or charlm / fragile (default charlm)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the task factory (repeatable), e.g. d_model=64")
    parser.add_argument("--dtype", default="both", choices=("bf16", "fp16", "both"),
                        help="the low-precision dtype(s) to check (default both)")
    parser.add_argument("--mode", default="storage", choices=("storage", "autocast"),
                        help="storage: parameters in 16 bits, as a deployment stores them (default); "
                             "autocast: fp32 parameters, 16-bit compute")
    parser.add_argument("--weights", default=None, metavar="PATH",
                        help="a state_dict saved with torch.save (fp32) to load into the task's model")
    parser.add_argument("--train-steps", type=count, default=0, metavar="N",
                        help="train the model in fp32 for N steps first (the task's optimizer and loss; default 0)")
    parser.add_argument("--batches", type=positive_int, default=8, metavar="N",
                        help="batches to compare on (default 8)")
    parser.add_argument("--first-batch", type=count, default=None, metavar="STEP",
                        help="get_batch step of the first batch (default: --train-steps, the first batch training "
                             "did not see)")
    parser.add_argument("--classes", default="auto", metavar="auto|none|NAME,...",
                        help="outputs whose last dim holds class scores (top-1, top-5): auto (outputs named *logits*, "
                             "else every output of 2+ dims), none, or output names ('output' for a lone tensor)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed before build_model (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of errors in the task's code")


def _classes(text: str) -> Any:
    t = text.strip()
    if t.lower() in ("auto", "none"):
        return t.lower()
    names = [n.strip() for n in t.split(",") if n.strip()]
    if not names:
        raise ValueError("--classes names no output; give auto, none, or output names such as logits")
    return names


class _Fail(Exception):
    """A message for the user, exit status 2."""


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)

    def error(message: str) -> int:
        err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)  # one line: greppable
        return 2

    try:
        task_kwargs = parse_task_args(args.task_arg)
        classes = _classes(args.classes)
    except ValueError as e:
        return error(str(e))
    try:
        report, task = _check(args, task_kwargs, classes, err)
    except _Fail as e:
        return error(str(e))
    except Exception as e:  # the task's own code (importing its module, its factory, its model)
        if args.traceback:
            raise
        cause = e.__cause__ if e.__cause__ is not None else e
        return error(f"{type(e).__name__}: {e}" + ("" if cause is e else f" ({type(cause).__name__})")
                     + " (run with --traceback for the full traceback)")
    if args.json:
        import json

        data = report.to_dict()
        data["task"] = {"name": task.name, "spec": args.task, "args": task_kwargs, "train_steps": args.train_steps,
                        "weights": args.weights, "first_batch": _first(args)}
        print(json.dumps(data, indent=2, allow_nan=False, default=str))
    else:
        from mixprec.inference.table import print_report
        from mixprec.report.terminal import make_console

        print_report(report, task, make_console(), _first(args))
    return report.exit_code


def _first(args: argparse.Namespace) -> int:
    return args.train_steps if args.first_batch is None else args.first_batch


def _check(args: argparse.Namespace, task_kwargs: dict[str, Any], classes: Any, err: Any) -> tuple[Any, Any]:
    import torch

    from mixprec.inference.check import InferenceCheckError, check_inference
    from mixprec.tasks import TaskError, load_task, to_device

    try:
        task = load_task(args.task, **task_kwargs)
    except TaskError as e:
        if args.traceback and e.__cause__ is not None:
            import traceback

            traceback.print_exception(e.__cause__)
        raise _Fail(str(e)) from None
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():  # the words compare and prepare use
            raise _Fail(f"--device {args.device!r} was asked for, but CUDA is not available in this torch build "
                        "or machine. Use --device cpu.")
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise _Fail(f"--device {args.device!r} cannot be used here: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = task.build_model().to(device)
    if args.weights:
        _load_weights(model, args.weights, err)
    if args.train_steps:
        if not args.json:
            err.print(f"[dim]... training {task.name} in fp32 for {args.train_steps} steps[/dim]")
        _train(task, model, args.train_steps, device)
    first = _first(args)

    def batches() -> Any:
        for step in range(first, first + args.batches):
            yield to_device(task.get_batch(step), device)

    try:
        report = check_inference(model, batches(), args.dtype, mode=args.mode, forward=task.run_forward,
                                 loss_fn=task.loss_fn, classes=classes)
    except InferenceCheckError as e:
        if args.traceback and e.__cause__ is not None:
            import traceback

            traceback.print_exception(e.__cause__)
        raise _Fail(str(e)) from None
    except ValueError as e:  # a model cast_for_inference refuses (16-bit parameters...)
        raise _Fail(str(e)) from None
    return report, task


def _load_weights(model: Any, path: str, err: Any = None) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _Fail(f"--weights {path!r}: no such file") from None
    except IsADirectoryError:
        raise _Fail(f"--weights {path!r} is a directory; pass the file torch.save(model.state_dict(), path) wrote") from None
    except Exception as e:
        _not_torch_save(path)  # an empty file, or not torch.save's format at all: said plainly
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # (no terminal escapes)
        if "Weights only load failed" in text and "Unsupported global" in text:  # most often torch.save(model)
            raise _Fail(f"--weights {path!r} holds pickled Python objects (a whole model saved with "
                        "torch.save(model)?), not a state_dict of tensors; mixprec never unpickles code. Save "
                        "torch.save(model.state_dict(), path) and pass that file") from None
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)  # not a pickle at all, or a torn one
        first = detail.group(1) if detail else (text.splitlines()[0] if text else "")
        raise _Fail(f"--weights {path!r} cannot be read as a torch.save file of tensors: {type(e).__name__}: "
                    f"{first} (the file is damaged, a truncated copy or an interrupted save?); save it again") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a checkpoint {"model": state_dict, "optimizer": ...}
    if not isinstance(state, dict):
        raise _Fail(f"--weights {path!r} holds a {type(state).__name__}, not a state_dict (save model.state_dict())")
    state = _with_tied(model, state)
    misfit = _misfit(model.state_dict(), state)
    if misfit:
        raise _Fail(f"--weights {path!r} does not fit the task's model: {misfit}. The task's model must be built "
                    "with the same shapes (see --task-arg), or pass the state_dict of this task's model")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise _Fail(f"--weights {path!r} does not fit the task's model: {' '.join(str(e).split())[:600]} "
                    "(the task's model must be built with the same shapes; see --task-arg)") from None
    note = _not_fp32(model.state_dict(), state)
    if note and err is not None:
        err.print(f"note: --weights {path!r} {note}", markup=False, highlight=False, soft_wrap=True)


def _with_tied(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the names of tied parameters it lacks (a safetensors file, ``save_pretrained``'s,
    holds ``lm_head.weight`` tied to the embedding once) filled from the name it holds."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = dict(state)
    for group in names.values():
        held = [n for n in group if n in state]
        for n in group:
            if held and n not in out:
                out[n] = state[held[0]]
    return out


def _not_fp32(mine: dict[str, Any], theirs: dict[str, Any], shown: int = 3) -> str:
    """What was said of floating tensors in ``theirs`` stored in another dtype than the model's fp32 ones
    (load_state_dict casts them without a word): '' when there are none."""
    import torch

    other: dict[str, list[str]] = {}
    for k, v in theirs.items():
        want = mine.get(k)
        if (isinstance(v, torch.Tensor) and v.is_floating_point() and isinstance(want, torch.Tensor)
                and want.dtype == torch.float32 and v.dtype != torch.float32):
            other.setdefault(str(v.dtype).replace("torch.", ""), []).append(k)
    if not other:
        return ""
    parts = ", ".join(f"{len(names)} in {dt} ({', '.join(names[:shown])}{' ...' if len(names) > shown else ''})"
                      for dt, names in other.items())
    sixteen = any(dt in ("bfloat16", "float16") for dt in other)
    return (f"holds floating tensors that are not fp32: {parts}; they were cast to the fp32 model's dtype, so the "
            "fp32 reference is these values" + (" (already rounded to 16 bits: casting them to bf16 / fp16 loses "
            "little or nothing, so the check is optimistic). If this is model.state_dict() of a 16-bit storage run "
            "(bf16-true...), save its fp32 masters instead: torch.save(mp.fp32_state_dict(model), path)"
            if sixteen else ""))


def _not_torch_save(path: str) -> None:
    """Refuse, saying so plainly, a file torch.load failed on that is empty or not torch.save's format at all
    (torch says "EOFError: " with nothing, or "KeyError: 101" for a text file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return
    if not head:
        raise _Fail(f"--weights {path!r} is an empty file (0 bytes), not a torch.save file: an interrupted save or "
                    "copy? Save the weights again with torch.save(model.state_dict(), path)")
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip archive, or its legacy pickle format
        raise _Fail(f"--weights {path!r} is not a torch.save file (it starts with {head!r}; torch.save writes a zip "
                    "archive). Pass the file torch.save(model.state_dict(), path) wrote")


def _misfit(mine: dict[str, Any], theirs: dict[str, Any], shown: int = 5) -> str:
    """The keys the model has that ``theirs`` lacks, the ones it has that the model does not, and the shapes
    that differ, a few of each with counts: '' when the state dict fits."""
    def few(items: list[str]) -> str:
        return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")

    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    shapes = [f"{k} {tuple(theirs[k].shape)} in the file, {tuple(v.shape)} in the model" for k, v in mine.items()
              if k in theirs and hasattr(theirs[k], "shape") and hasattr(v, "shape") and theirs[k].shape != v.shape]
    parts = [f"{len(missing)} missing ({few(missing)})" if missing else "",
             f"{len(unexpected)} unexpected ({few(unexpected)})" if unexpected else "",
             f"{len(shapes)} of another shape ({few(shapes)})" if shapes else ""]
    return "; ".join(p for p in parts if p)


def _train(task: Any, model: Any, steps: int, device: Any) -> None:
    import torch

    from mixprec.tasks import to_device

    model.train()
    opt = task.build_optimizer(model.parameters())
    for step in range(steps):
        inputs, targets = to_device(task.get_batch(step), device)
        loss = task.loss_fn(task.run_forward(model, inputs), targets)
        if not torch.isfinite(loss):
            raise _Fail(f"fp32 training of {task.name} reached a non-finite loss at step {step + 1}: fix the task "
                        "in fp32 first (the seeds' check 1), or use --train-steps 0")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if task.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.max_grad_norm)
        opt.step()
    model.eval()
