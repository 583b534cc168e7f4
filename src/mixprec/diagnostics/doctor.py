"""``doctor``: the mixed-precision debugging checklist, run on your model and batch.

    report = mixprec.doctor("mypkg.tasks:make_task", recipe="fp16-mixed")
    print(report.render_text())
    report.write("mixprec-report")          # doctor.html (with the gradient histogram), doctor.json

It trains a few steps under the recipe inside a NaN guard, the same step in fp32 (and in bf16 when
the recipe's step fails), then probes gradient underflow, update vanishing and activation range
in fp32, and goes through the checklist (``checks.py``). Each finding says what was seen, the
evidence, and the fix; ``report.alarming`` is True when a finding is an alarm.

On a CPU without native 16-bit matmuls the 16-bit steps are emulated and slow: the default is a
few steps on the task's first batches. Each judgement is made on the state the recipe trains in:
a loss scaler still backing off from its initial scale runs on until its first clean step (at most
``SETTLE_STEPS`` more), gradient underflow is judged at the scale it then trains at, and the fp8
casts are probed after the run's steps (delayed scaling has no history at step 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.causes import CAST_OPS
from mixprec.diagnostics.checks import Evidence, NormStat, run_checklist
from mixprec.diagnostics.doctor_report import DoctorReport
from mixprec.diagnostics.doctor_runs import build, run_steps
from mixprec.diagnostics.probes.activations import probe_activation_range
from mixprec.diagnostics.probes.fp8 import probe_fp8_casts
from mixprec.diagnostics.probes.gradients import probe_grad_underflow
from mixprec.diagnostics.probes.updates import probe_update_vanishing
from mixprec.islands import is_norm, looks_like_norm
from mixprec.masters import fp32_param_names
from mixprec.recipes import as_device, resolve_recipe
from mixprec.tasks import Task, TaskError, load_task, to_device

#: at most this many steps past ``steps`` while the scaler is still halving down from its initial
#: scale (every step skipped for a backward overflow, the forward finite): 2^16 -> 2^0
SETTLE_STEPS = 16


def _norm_like(module: nn.Module) -> bool:
    """Norms the recipes recognise, and modules that look like one (checked for tiny variances too)."""
    return is_norm(module) or looks_like_norm(module)


def _measure_norms(model: nn.Module, forward: Callable[[], Any]) -> dict[str, tuple[str, float]]:
    """Smallest per-row variance (over the last dim, in fp32) of each norm-like module's input."""
    found: dict[str, tuple[str, float]] = {}

    def hook(name: str, module: nn.Module, args: tuple) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if x is not None and x.numel() > 1 and x.shape[-1] > 1:
            v = float(x.detach().float().var(-1, unbiased=False).min())
            found[name] = (type(module).__name__, min(v, found.get(name, ("", v))[1]))

    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: hook(n, mod, a))
               for n, m in model.named_modules() if n and _norm_like(m)]
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    return found


def _probe(ev: Evidence, task: Task, device: torch.device, seed: int, progress: Callable[[str], None]) -> None:
    inputs, targets = to_device(task.get_batch(0), device)

    def fp32_closure(model: nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: task.loss_fn(task.run_forward(model, inputs), targets)

    model32, _ = build(task, "fp32", device, seed)
    progress("probing gradient underflow (fp32 backward)")
    try:  # at the scale the recipe trains at (after the scaler's initial back-off), not its first
        ev.grads = probe_grad_underflow(model32, fp32_closure(model32), scales=[ev.run.train_scale])
    except Exception as e:
        ev.errors["grads"] = f"{type(e).__name__}: {e}"
    progress("probing update vanishing (one fp32 optimizer step)")
    try:
        ev.updates = probe_update_vanishing(model32, task.build_optimizer(model32.parameters()), fp32_closure(model32))
    except Exception as e:
        ev.errors["updates"] = f"{type(e).__name__}: {e}"
    progress(f"probing activation range (fp32, and {ev.recipe.name} forward)")
    try:
        with torch.no_grad():
            act32 = probe_activation_range(model32, lambda: task.run_forward(model32, inputs))
            norms32 = _measure_norms(model32, lambda: task.run_forward(model32, inputs))
            model_r, mp = build(task, ev.recipe.name, device, seed)
            with mp.autocast():
                act_r = probe_activation_range(model_r, lambda: task.run_forward(model_r, inputs))
        ev.activations = act32.at_risk_under(act_r)
        # modules that compute in 16 bits: an op other than a cast (an island casts its output back) gave 16 bits
        sixteen = {e.module for e in act_r.entries
                   if e.op is not None and e.op not in CAST_OPS and e.dtype in (torch.float16, torch.bfloat16)}
        ev.norms = [NormStat(n, t, v, n in sixteen) for n, (t, v) in norms32.items()]
    except Exception as e:
        ev.errors["activations"] = f"{type(e).__name__}: {e}"
    if ev.recipe.fp8 is not None:
        progress(f"probing the fp8 casts ({ev.recipe.name} forward and backward, after its {len(ev.run.losses)} step(s))")
        try:
            ev.fp8 = _probe_fp8(ev, task, device, seed)
        except Exception as e:
            ev.errors["fp8"] = f"{type(e).__name__}: {e}"


def _probe_fp8(ev: Evidence, task: Task, device: torch.device, seed: int) -> list[Any]:
    """The fp8 casts in the state the recipe trains in: on the run's model after its steps (delayed
    scaling has an amax history from step 1 on; at step 0 every scale is 1), with the next batch.
    A run that failed or left non-finite losses has no such state: a fresh model is probed then."""
    run = ev.run
    if run.model is not None and run.finite and run.losses:
        model_f, mp_f, step = run.model, run.mp, len(run.losses)
    else:
        (model_f, mp_f), step = build(task, ev.recipe.name, device, seed), 0
    inputs, targets = to_device(task.get_batch(step), device)
    ev.fp8_step = step
    return probe_fp8_casts(model_f, lambda: task.loss_fn(task.run_forward(model_f, inputs), targets),
                           autocast=mp_f.autocast)


def doctor(
    task: str | Task | Callable[..., Task] | None = None,
    recipe: str = "fp16-mixed",
    device: str | torch.device | None = None,
    *,
    steps: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    task_kwargs: dict[str, Any] | None = None,
) -> DoctorReport:
    """Run the mixed-precision checklist on ``task`` (default: the built-in char-level GPT).

    Args:
        task: a ``Task``, a factory, or ``"module:function"`` (see ``mixprec.tasks``).
        recipe: the recipe to examine (default fp16-mixed, the demanding one; any recipe name or
            jmp policy string). ``"auto"`` resolves for the device.
        device: where to run (default CUDA when available).
        steps: steps under the recipe (the loss-scale check needs a few; more on a GPU is cheap).
        seed: model initialisation seed (the same for every run).
        progress: called with a line before each stage (the CLI prints them).
        task_kwargs: keyword arguments for the task factory (``--task-arg KEY=VALUE``).
    """
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    dev = as_device(device)
    if isinstance(task, Task) and task_kwargs:
        raise ValueError("task_kwargs go to a task factory; a ready Task takes none (pass its factory instead)")
    the_task = load_task(task, **(task_kwargs or {}))
    rec = resolve_recipe(recipe, dev)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    say(f"running {steps} step(s) of {the_task.name} under {rec.name}, guarded")
    run = run_steps(the_task, rec.name, dev, steps=steps, seed=seed, settle=SETTLE_STEPS)
    if run.settle_steps:
        say(f"ran {run.settle_steps} more step(s) until the loss scale settled (the scaler skipped every step before)")
    say("running the same step in fp32")
    f32 = run_steps(the_task, "fp32", dev, steps=1, seed=seed) if rec.name != "fp32" else run
    if f32.error is not None:  # the task itself does not train (a loss that is no tensor, a shape error): no finding
        raise TaskError(
            f"task {the_task.name!r}: its step fails in plain fp32 ({f32.error}"
            + (f", raised at {f32.error_at}" if f32.error_at else "") + "), so there is no mixed-precision question "
            "to examine yet; make the task train in plain fp32 first"
        )
    ev = Evidence(rec, run, f32)
    if rec.stores_16bit:  # which parameters the recipe's rule keeps in fp32 (not at risk of vanishing)
        torch.manual_seed(seed)
        ev.kept_fp32 = frozenset(fp32_param_names(the_task.build_model(), rec.fp32_params))
    if run.faulty and not f32.faulty and rec.policy.compute_dtype != torch.bfloat16:
        # as many steps as it took the recipe to fail, at least one
        n = next((i + 1 for i, v in enumerate(run.losses) if v != v or abs(v) == float("inf")), 1)
        say(f"running {n} step(s) under bf16-mixed")
        try:
            ev.bf16 = run_steps(the_task, "bf16-mixed", dev, steps=n, seed=seed)
        except Exception as e:
            ev.errors["bf16"] = f"{type(e).__name__}: {e}"
    _probe(ev, the_task, dev, seed, say)
    findings = run_checklist(ev)
    return DoctorReport(the_task.name, the_task.description, rec.name, str(dev), findings, ev, time.perf_counter() - t0)
