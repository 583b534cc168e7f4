"""MP120: a learning-rate scheduler stepped on the iterations the GradScaler skipped.

``scaler.step(optimizer)`` skips the optimizer's step when the gradients hold inf/NaN; a
``scheduler.step()`` after it in the same iteration (the innermost loop around the scaler's
step, or a step function with no loop, which a framework calls once per batch) advances the
schedule anyway. Not reported when the function reads the scale back between the step and
the scheduler (``scaler.get_scale()``) or the scheduler runs under a test of a skip (``if not
skip_scheduler:``). Reported once per file: it is worth knowing, rarely worth more than a few
steps of schedule (severity "info").
"""

from __future__ import annotations

import ast

from mixprec.lint.events import Branch, exclusive_either, opposite_arms, place, show
from mixprec.lint.events import via as _via
from mixprec.lint.names import key_of


def _drives(fc, sched, step, loop) -> bool:
    """Whether ``sched`` may schedule the optimizer ``step`` steps: built over it (when its
    construction names an optimizer), else the only optimizer stepped in the loop."""
    home, local = fc.origins.get(sched.target, (fc.script, sched.target))
    built = [v for v in (home.assigns.get(local, []) if local else []) if isinstance(v, ast.Call)]
    named = {key_of(a) for v in built for a in (*v.args, *(kw.value for kw in v.keywords))} - {None}
    optimizers = {k for k in named if home.is_optimizer(k)}
    if optimizers:  # LambdaLR(optimizer, ...), get_scheduler(cfg, optimizer, steps)
        _, target = fc.origins.get(step.target, (None, step.target))
        return target in optimizers or show(step.target) in optimizers
    stepped = {e.target for e in (*fc.of("opt_step"), *fc.of("scaler_step")) if loop is None or loop in e.path}
    return len(stepped) == 1


def _tells_skip(test: ast.expr) -> bool:
    words = [n.id for n in ast.walk(test) if isinstance(n, ast.Name)] + [
        n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)]
    return any("skip" in w.lower() or w == "get_scale" for w in words)


def scheduler_after_skip(fc) -> None:  # MP120
    checks = fc.of("skip_check")
    for sched in fc.of("sched_step"):
        if any(isinstance(p, Branch) and p.test is not None and _tells_skip(p.test) for p in sched.path):
            continue  # ``if not skip_scheduler: scheduler.step()``
        # the same iteration: the innermost loop around both, or no loop at all (a step
        # function a framework calls once per batch: run_step, training_step)
        loop = sched.loops[-1] if sched.loops else None
        steps = [
            s for s in fc.of("scaler_step")
            if fc.live(s.scaler) and (s.loops[-1] if s.loops else None) == loop and s.order < sched.order
            and not exclusive_either(s, sched) and not opposite_arms(s, sched)
        ]
        steps = [s for s in steps if _drives(fc, sched, s, loop)]
        # the scale read back between the step and the scheduler: the code can tell a skipped step
        steps = [s for s in steps if not any(s.order < c.order < sched.order for c in checks)]
        if steps:
            step = steps[-1]
            fc.hit(
                "MP120",
                place(sched, step),
                f"{show(sched.target)}.step() runs even when {show(step.scaler)}.step() (line {step.line}) skipped "
                f"the optimizer's step for inf/NaN gradients: the schedule runs ahead of the weights{_via(sched)}",
            )
            return
