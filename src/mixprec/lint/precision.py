"""MP107 and MP108: a GradScaler with bf16, fp16 with no GradScaler, dtypes chosen at run time.

Read from one function's events (see ``flow``): the autocast regions entered (with gradients
on), the backward()s and the scalers they were scaled by.

* MP107, fixed dtype: every region is bf16 and the scaler is enabled, literally or by the very
  switch that turns the bf16 autocast on (``GradScaler(enabled=flag)`` next to
  ``autocast(dtype=torch.bfloat16, enabled=flag)``): it is on exactly when it is not needed.
* MP107, dtype chosen at run time: a region's dtype may be fp16 or bf16
  (``torch.bfloat16 if use_bf16 else torch.float16``, ``amp_dtype`` set in two branches) and the
  scaler is on whatever the dtype (``GradScaler()``, ``GradScaler() if use_amp else None``): its
  switch names nothing the dtype is chosen from and no fp16 word (``enabled=(dtype ==
  "float16")`` is the right way and stays silent).
* MP108: an fp16 region (or one that may be fp16) and an unscaled backward() that can run in
  the same pass, with no GradScaler in the function (nor, for a run-time choice, in the file).
"""

from __future__ import annotations

import ast
import re

from mixprec.lint.dtypes import values
from mixprec.lint.events import Event, exclusive, opposite_arms, place, show
from mixprec.lint.events import via as _via
from mixprec.lint.names import SCALERS, Script, argument, key_of

_FP16_WORDS = re.compile(r"16|half|bf|dtype|precision", re.I)


def _switches(script: Script, key: str) -> list[ast.expr] | None:
    """What turns the scaler ``key`` of ``script`` on: its ``enabled=`` expression, the test of
    ``GradScaler() if test else None``, the tests of the ``if``s around its construction. [] when
    it is on whenever it exists; None when its construction is not seen."""
    bound = script.assigns.get(key) or []
    out: list[ast.expr] = []
    seen = False
    for value in bound:
        arms = [(value, None)]
        if isinstance(value, ast.IfExp):
            arms = [(value.body, value.test), (value.orelse, value.test)]
        for arm, test in arms:
            if not (isinstance(arm, ast.Call) and script.qualname(arm.func) in SCALERS):
                continue
            seen = True
            enabled = argument(arm, SCALERS[script.qualname(arm.func)], "enabled")
            if enabled is not None and not isinstance(enabled, ast.Constant):
                out.append(enabled)
            if test is not None:
                out.append(test)
            out.extend(_guards(script, value))
    return out if seen else None


def _guards(script: Script, node: ast.AST) -> list[ast.expr]:
    """The tests of the ``if`` statements around ``node`` (up to its function)."""
    out = []
    current = script.parent(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        if isinstance(current, ast.If):
            out.append(current.test)
        current = script.parent(current)
    return out


def _words(nodes) -> set[str]:
    """The whole names (``args.amp``, not ``args``) and the strings in ``nodes``."""
    out = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        k = key_of(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
        if k is not None:
            out.add(k)
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
        todo.extend(ast.iter_child_nodes(n))
    return out


def _choice_words(script: Script, dtype_arg: ast.expr | None) -> set[str]:
    """The names a run-time dtype is chosen from: those in its expression, in the values its
    name is given, and in the tests of the ``if``s around those assignments."""
    if dtype_arg is None:
        return set()
    parts: list[ast.AST] = [dtype_arg]
    for node in ast.walk(dtype_arg):
        if isinstance(node, (ast.Name, ast.Attribute)):
            for value in values(script, node) or []:
                parts.append(value)
                parts.extend(_guards(script, value))
    return _words(parts) - {"torch.float16", "torch.bfloat16", "torch.half", "torch.float32", "float16", "bfloat16"}


def check(fc) -> None:  # FunctionChecks: MP107, MP108
    regions = [e for e in fc.of("autocast") if e.ctx[-1].autocast.enabled is not False]
    backs = fc.of("backward")
    scaled = [b for b in backs if b.loss == "scaled" and fc.live(b.scaler)]
    _scaler_with_bf16(fc, regions, scaled)
    _fp16_without_scaler(fc, regions, backs, scaled)


def _scaler_with_bf16(fc, regions: list[Event], scaled: list[Event]) -> None:
    if not regions or not scaled:
        return
    autocasts = [e.ctx[-1].autocast for e in regions]
    if all(a.dtype == "bf16" for a in autocasts):
        for back in scaled:
            enabled = fc.scaler_enabled(back.scaler)
            switches = _scaler_switches(fc, back.scaler)
            same = switches and any(
                a.switch is not None and any(ast.dump(a.switch) == ast.dump(s) for s in switches) for a in autocasts
            )
            if enabled is True or same:
                why = "" if enabled is True else ", enabled by the same switch as the bf16 autocast"
                fc.hit("MP107", place(back, *regions),
                       f"GradScaler {show(back.scaler)} used with bf16 autocast{why}, which needs no loss scaling{_via(back)}")
                return
    chosen = [(e, e.ctx[-1].autocast) for e in regions]
    chosen = [(e, a) for e, a in chosen if a.dtypes is not None and {"fp16", "bf16"} <= a.dtypes]
    for region, autocast in chosen:
        words = _choice_words(region.script, autocast.dtype_arg)
        for back in scaled:
            switches = _scaler_switches(fc, back.scaler)
            if switches is None:
                continue  # not built where we can see how it is switched
            said = _words(switches)
            # the autocast's own on/off switch: the scaler is on whenever the autocast is, whatever
            # dtype the other flag chose (GradScaler(enabled=fp16_run) and autocast(enabled=fp16_run, dtype=half))
            follows = autocast.switch is not None and any(ast.dump(autocast.switch) == ast.dump(s) for s in switches)
            if said & words or (any(_FP16_WORDS.search(w) for w in said) and not follows):
                continue  # enabled from the dtype choice (or an fp16 flag): the right way
            text = ast.unparse(autocast.dtype_arg) if autocast.dtype_arg is not None else "the dtype"
            fc.hit("MP107", place(back, region),
                   f"GradScaler {show(back.scaler)} is enabled whatever the autocast dtype ({text}: float16 or "
                   f"bfloat16 at run time): enable it only for fp16, "
                   f"GradScaler(enabled=({text} == torch.float16)){_via(back)}")
            return


def _scaler_switches(fc, scaler: str | None) -> list[ast.expr] | None:
    if scaler is None:
        return None
    home, local = fc.origins.get(scaler, (fc.script, scaler))
    return _switches(home, local)


def _fp16_without_scaler(fc, regions: list[Event], backs: list[Event], scaled: list[Event]) -> None:
    scaler_used = scaled or any(e.kind in ("scaler_step", "unscale", "update", "escape") for e in fc.events)
    if scaler_used:
        return
    # a region run without gradients (an evaluation under torch.no_grad()) feeds no backward()
    fp16 = [e for e in regions if not fc._without_grad(e)]
    fp16 = [e for e in fp16 if e.ctx[-1].autocast.dtype == "fp16" or (
        e.ctx[-1].autocast.dtypes is not None and "fp16" in e.ctx[-1].autocast.dtypes and not e.script.scaler_keys
        and not fc.script.scaler_keys)]
    plain = [b for b in backs if b.loss == "plain" or (b.loss == "scaled" and not fc.live(b.scaler))]
    # a region and a backward() that cannot run in one pass (``if amp:`` ... ``else:``) are no pair
    pairs = [
        (r, b)
        for r in fp16
        for b in plain
        if not (exclusive(r, b) if r.order < b.order else exclusive(b, r)) and not opposite_arms(r, b)
    ]
    # cite the backward() the region feeds: the first one after it, not an fp32 backward() that
    # runs before the region (llm.c's debug pass before its training loop: found by a probe of
    # real scripts)
    pair = min(pairs, key=lambda p: (p[1].order < p[0].order, abs(p[1].order - p[0].order)), default=None)
    if pair is not None:
        region, back = pair
        autocast = region.ctx[-1].autocast
        when = ""
        if autocast.dtype != "fp16" and autocast.dtype_arg is not None:
            when = f" (when {ast.unparse(autocast.dtype_arg)} is float16)"
        fc.hit("MP108", place(region, back),
               f"float16 autocast{when} with no GradScaler: backward() on line {back.line} runs on an unscaled "
               f"loss{_via(region)}")

