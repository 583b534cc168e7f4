"""The MP1xx rules: each reads the events of one function (see ``flow``) or the whole file.

Every rule errs towards silence: when a name cannot be resolved, a dtype is decided at run time,
or a scaler is handed to code that cannot be read, the rule does not report.
"""

from __future__ import annotations

import ast
from collections import defaultdict

from mixprec.lint.casts import half_model_hits
from mixprec.lint.checkpoints import checkpoint_hits, method_calls
from mixprec.lint.coverage import coverage_hits
from mixprec.lint.events import (
    Branch, Event, before as _before, between as _between, exclusive, opposite_arms, place,
    show, via as _via,
)
from mixprec.lint import precision
from mixprec.lint.accumulation import Accumulation
from mixprec.lint.disabled import disabled_hits
from mixprec.lint.flow import Flow
from mixprec.lint.names import Script, key_of, last
from mixprec.lint.report import Hit
from mixprec.lint.schedules import scheduler_after_skip
from mixprec.lint.syncs import sync_hits



class FunctionChecks:
    """The rules that read one function's events."""

    def __init__(self, script: Script, events: list[Event], origins: dict | None = None):
        self.script = script
        self.events = events
        self.origins = origins or {}  # key -> (file, local key) where the object was made
        self.hits: list[Hit] = []
        # the events by kind and by (kind, scaler), in order: the rules look events up here
        # instead of scanning them all for every event, which is quadratic in a long module
        self._kinds: dict[str, list[Event]] = defaultdict(list)
        self._scalers: dict[tuple[str, str | None], list[Event]] = defaultdict(list)
        for e in events:
            self._kinds[e.kind].append(e)
            self._scalers[e.kind, e.scaler].append(e)

    def of(self, kind: str, scaler: str | None = "") -> list[Event]:
        """The ``kind`` events in order; with ``scaler``, only those of that scaler."""
        return self._kinds.get(kind, []) if scaler == "" else self._scalers.get((kind, scaler), [])

    def hit(self, code: str, node: ast.AST | None, message: str) -> None:
        if node is not None:
            self.hits.append(Hit(code, node, message))

    def scaler_enabled(self, scaler: str | None) -> bool | None:
        """True/False when every construction of the scaler says so literally; None otherwise."""
        if scaler is None:
            return None
        home, local = self.origins.get(scaler, (self.script, scaler))
        return home.scaler_enabled(local)

    def live(self, scaler: str | None) -> bool:
        """False only for a scaler every construction of which says ``enabled=False``."""
        return self.scaler_enabled(scaler) is not False

    def run(self) -> list[Hit]:
        for check in (
            self.clip_before_unscale,
            self.in_autocast,
            self.step_bypasses_scaler,
            self.update_outside_loop,
            self.update_twice,
            self.step_twice,
            self.precision_and_scaler,
            self.step_on_unscaled,
        ):
            check()
        Accumulation(self).run()  # MP114, MP116, MP118
        scheduler_after_skip(self)  # MP120
        return self.hits

    def scaled_backward_before(self, event: Event) -> Event | None:
        """The backward() that produced the gradients ``event`` sees, when a live scaler scaled it."""
        back = _before(self.of("backward"), event)
        if back is None or back.loss != "scaled" or not self.live(back.scaler):
            return None
        return back

    def clip_before_unscale(self) -> None:  # MP101
        for clip in self.of("clip"):
            back = self.scaled_backward_before(clip)
            if back is None:
                self.clip_after_accelerate(clip)
                continue
            unscales = self.of("unscale", back.scaler)
            if any(not exclusive(u, clip) for u in _between(unscales, back, clip)):
                continue
            later = bool(unscales) and unscales[-1].order > clip.order
            what = (
                f"clipped before {show(back.scaler)}.unscale_()"
                if later
                else f"clipped while still scaled: no {show(back.scaler)}.unscale_() between backward() and the clip"
            )
            self.hit("MP101", place(clip, back), f"gradients {what}{_via(clip)}")

    def clip_after_accelerate(self, clip: Event) -> None:  # MP101, Accelerate's GradScaler
        """``accelerator.backward(loss)`` scales the loss when the Accelerator is built with
        ``mixed_precision="fp16"`` (visibly: see ``dtypes.accelerator_precisions``); a plain
        ``torch.nn.utils.clip_grad_norm_`` then clips scaled gradients, where
        ``accelerator.clip_grad_norm_`` unscales first."""
        back = _before(self.of("backward"), clip)
        if back is None or back.loss != "managed" or "fp16" not in (back.precisions or ()):
            return
        if any(not exclusive(u, clip) for u in _between(self.of("accel_unscale"), back, clip)):
            return  # accelerator.unscale_gradients() first
        who = show(back.target)
        name = "clip_grad_value_" if "value" in ast.unparse(clip.node.func) else "clip_grad_norm_"
        mode = 'under mixed_precision="fp16"' if back.precisions == {"fp16"} else 'when mixed_precision is "fp16"'
        self.hit(
            "MP101",
            place(clip, back),
            f"gradients clipped while still scaled: {who}.backward() scales the loss {mode}; use "
            f"{who}.{name}(), which unscales first, or call {who}.unscale_gradients() before the clip{_via(clip)}",
        )

    def in_autocast(self) -> None:  # MP102, MP109, MP110
        for event in self.events:
            region = event.region
            if region is None:
                continue
            if event.kind == "backward":
                self.hit("MP102", place(event, region), f"backward() inside an autocast region{_via(event)}")
            elif event.kind in ("opt_step", "scaler_step"):
                who = event.target if event.kind == "opt_step" else event.scaler
                self.hit("MP109", place(event, region), f"{show(who)}.step() inside an autocast region{_via(event)}")
            elif event.kind == "loss_call" and event.sensitivity.under(region.autocast.device, region.autocast.dtype):
                self.hit(
                    "MP110",
                    place(event, region),
                    f"custom loss {event.name}() uses log/exp/pow/division and runs under autocast",
                )

    def step_bypasses_scaler(self) -> None:  # MP103
        for step in self.of("opt_step"):
            back = self.scaled_backward_before(step)
            if back is None:
                continue
            if any(isinstance(p, Branch) and p.guard and p not in back.path for p in step.path):
                continue  # a hand-written inf check decides the step
            if opposite_arms(back, step):
                continue  # ``if use_scaler: ...backward()`` then ``if use_scaler: ... else: opt.step()``
            if any(s.target == step.target and _other_arm(s, step) for s in self.of("scaler_step")):
                continue  # ``if scaling: scaler.step(opt) else: opt.step()``: the direct step is the unscaled path
            unscaled = [u for u in _between(self.of("unscale", back.scaler), back, step) if not exclusive(u, step)]
            if unscaled:  # the gradients have the right size, but nothing skips an inf/NaN step
                what = (
                    f"{show(step.target)}.step() called directly after {show(back.scaler)}.unscale_(): an inf/NaN "
                    f"step is applied, not skipped"
                )
            else:
                what = f"{show(step.target)}.step() called directly after {show(back.scaler)}.scale(loss).backward()"
            self.hit("MP103", place(step, back), f"{what}; use {show(back.scaler)}.step({show(step.target)}){_via(step)}")

    def update_outside_loop(self) -> None:  # MP104 (the in-function half)
        updated_in: dict[str | None, set] = defaultdict(set)  # scaler -> the loops it is updated in
        for u in self.of("update"):
            updated_in[u.scaler].update(u.loops)
        escapes_in = defaultdict(list)  # loop -> the escapes inside it
        for e in self.of("escape"):
            for lp in e.loops:
                escapes_in[lp].append(e)
        for step in self.of("scaler_step"):
            if not self.live(step.scaler):
                continue
            root = (step.target or "").split(".")[0]
            loops = [lp for lp in step.loops if root not in lp.targets]
            if not loops:
                continue
            loop = loops[-1]
            updates = self.of("update", step.scaler)
            if not updates or loop in updated_in[step.scaler]:
                continue
            if any(_may_reach(e, step.scaler) for e in escapes_in.get(loop, ())):
                continue
            self.hit(
                "MP104",
                place(step, *updates),
                f"{show(step.scaler)}.step() runs every iteration but {show(step.scaler)}.update() is outside the loop{_via(step)}",
            )

    def update_twice(self) -> None:  # MP105
        groups: dict[tuple, list[Event]] = defaultdict(list)  # (scaler, loops) -> updates in order
        for update in self.of("update"):
            groups[update.scaler, update.loops].append(update)
        for updates in groups.values():
            for i, second in enumerate(updates):
                first = next((f for f in updates[:i] if not exclusive(f, second)), None)
                if first is not None:
                    self.hit(
                        "MP105",
                        place(second, first),
                        f"{show(second.scaler)}.update() called again in the same step (first on line "
                        f"{(first.site or first.node).lineno}){_via(second)}",
                    )
        steps_in: dict[tuple, list[Event]] = defaultdict(list)  # (scaler, loop) -> scaler steps in it
        for step in self.of("scaler_step"):
            for lp in step.loops:
                steps_in[step.scaler, lp].append(step)
        for update in self.of("update"):
            for lp in update.loops:
                if any((s.target or "").split(".")[0] in lp.targets for s in steps_in.get((update.scaler, lp), ())):
                    step = next(s for s in steps_in[update.scaler, lp] if (s.target or "").split(".")[0] in lp.targets)
                    self.hit(
                        "MP105",
                        place(update, step),
                        f"{show(update.scaler)}.update() inside the loop over optimizers: once per optimizer, "
                        f"not once per step{_via(update)}",
                    )
                    break

    def step_twice(self) -> None:  # MP113
        """``scaler.step(opt)`` and ``opt.step()`` on one optimizer in one pass, with no backward()
        between them that could run in that pass: the second applies the same gradients again."""
        backs = self.of("backward")
        directs: dict[tuple, list[Event]] = defaultdict(list)  # (optimizer, loops) -> its direct steps
        for direct in self.of("opt_step"):
            directs[direct.target, direct.loops].append(direct)
        reported: set[int] = set()
        for via_scaler in self.of("scaler_step"):
            for direct in directs.get((via_scaler.target, via_scaler.loops), ()):
                a, b = sorted((via_scaler, direct), key=lambda e: e.order)
                if exclusive(a, b) or opposite_arms(a, b) or id(direct.node) in reported:
                    continue
                if any(not exclusive(a, k) and not exclusive(k, b) and not opposite_arms(a, k)
                       and not opposite_arms(k, b) for k in _between(backs, a, b)):
                    continue  # a new backward() in between: two steps for two gradients
                reported.add(id(direct.node))
                self.hit(
                    "MP113",
                    place(direct, via_scaler),
                    f"{show(direct.target)} is stepped twice in one pass: {show(via_scaler.scaler)}.step({show(via_scaler.target)}) "
                    f"on line {(via_scaler.site or via_scaler.node).lineno} already called {show(direct.target)}.step()"
                    f"{_via(direct)}",
                )

    def precision_and_scaler(self) -> None:  # MP107, MP108
        precision.check(self)

    def _without_grad(self, e: Event) -> bool:
        """The event, or the call in the analysed function that led to it, runs with grads off."""
        return e.script.without_grad(e.node) or (e.site is not None and self.script.without_grad(e.site))

    def step_on_unscaled(self) -> None:  # MP112
        scaled = {b.scaler for b in self.of("backward") if b.loss == "scaled"}
        for step in self.of("scaler_step"):
            back = _before(self.of("backward"), step)
            if back is None or back.loss != "plain" or not self.live(step.scaler):
                continue
            if step.scaler in scaled:
                continue
            self.hit(
                "MP112",
                place(back, step),
                f"backward() on an unscaled loss, then {show(step.scaler)}.step() unscales the gradients; "
                f"use {show(step.scaler)}.scale(loss).backward(){_via(back)}",
            )


def _other_arm(a: Event, b: Event) -> bool:
    """Whether ``a`` and ``b`` sit in two arms of one ``if`` (in one frame)."""
    for pa, pb in zip(a.path, b.path):
        if pa == pb:
            continue
        return isinstance(pa, Branch) and isinstance(pb, Branch) and pa.node_id == pb.node_id and pa.frame == pb.frame
    return False


def _may_reach(escape: Event, scaler: str | None) -> bool:
    return escape.scaler == scaler or (escape.scaler == "self" and (scaler or "").startswith("self."))


# --- rules that read the whole file ---------------------------------------------------------


def file_checks(script: Script) -> list[Hit]:
    return [
        *_update_never_called(script), *half_model_hits(script), *checkpoint_hits(script), *coverage_hits(script),
        *disabled_hits(script), *sync_hits(script),
    ]


def _update_never_called(script: Script) -> list[Hit]:  # MP104 (the whole-file half)
    """A scaler that is stepped but never updated anywhere in the file, and never handed to
    code that might update it (compared by last name: ``self.scaler`` and ``trainer.scaler``
    may be one object). A scaler the stepping function receives as a parameter belongs to
    its caller, which may update it after the call (a runner calling ``train_step``)."""
    updated = {last(k) for k, _ in method_calls(script, "update") if script.is_scaler(k)}
    passed = set()
    for call in script.calls:
        for arg in [*call.args, *(kw.value for kw in call.keywords)]:
            k = key_of(arg)
            if k is not None:
                passed.add(last(k))
    hits = []
    for k, call in method_calls(script, "step"):
        name = last(k)
        if not script.is_scaler(k) or script.scaler_enabled(k) is False:
            continue
        if name in updated or name in passed or ("self" in passed and k.startswith("self.")):
            continue
        if _received(script, call, k):
            continue
        hits.append(Hit("MP104", call, f"{k}.step() but {k}.update() is never called"))
    return hits


def _received(script: Script, node: ast.AST, k: str) -> bool:
    """Whether ``k`` is (an attribute of) a parameter of the function around ``node``, other
    than ``self``/``cls``: an object the caller made and still holds."""
    func = script.owner(node)
    if func is None:
        return False
    root = k.split(".")[0]
    a = func.args
    params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    return root in params and root not in ("self", "cls")


def check(script: Script) -> list[Hit]:
    """All MP1xx hits of a file, each place reported once."""
    hits = file_checks(script)
    walk = script.scaler_keys or script.uses_autocast or any(
        isinstance(c.func, ast.Attribute) and c.func.attr in ("backward", "autocast") for c in script.calls
    )
    if walk:  # else no event rule can fire: skip the walk
        flow = Flow(script)
        bodies = [script.tree] + [f for defs in (*script.functions.values(), *script.methods.values()) for f in defs]
        for body in bodies:
            hits.extend(FunctionChecks(script, flow.function(body), flow.origins).run())
    unique: dict[tuple, Hit] = {}
    for h in hits:
        unique.setdefault((h.code, h.node.lineno, h.node.col_offset), h)
    notes = sorted((h for h in unique.values() if h.code == "MP120"), key=lambda h: h.node.lineno)
    return [h for h in unique.values() if h.code != "MP120"] + notes[:1]  # MP120: once per file
