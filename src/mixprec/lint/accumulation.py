"""MP114, MP116, MP118: gradient accumulation against the GradScaler's once-per-step calls.

A *micro-batch loop* is a loop with a backward() on every iteration (not only under an ``if``
on its counter) and no ``zero_grad()`` on every iteration (else nothing accumulates). Its *accumulation boundary* is an ``if`` whose test changes from one iteration
to the next like a step counter does (``(i + 1) % accum == 0``, ``ni - last_opt_step >=
accumulate``, ``should_step``), or what follows an early ``continue`` under such a test (``if
(i + 1) % accum: continue``); a guard on the data (``if short_batch: continue``, ``if x is
None: continue``) is no boundary: what follows it still runs on every other micro-batch.

* MP114: ``unscale_`` on every micro-batch, ``update()`` only at the boundary or after the loop;
* MP116: ``update()`` on every micro-batch, every ``scaler.step()`` only at the boundary;
* MP118: a clip on every micro-batch, the optimizer step only at the boundary.
"""

from __future__ import annotations

import ast
from collections import defaultdict

from mixprec.lint.events import Branch, Event, Loop, exclusive_either, place, show
from mixprec.lint.events import via as _via

_BOUNDARY_WORDS = ("accum", "boundary", "sync", "step", "update")


def boundary_test(test: ast.expr, loop: Loop, strict: bool = False) -> bool:
    """A test that changes from one iteration of ``loop`` to the next: a ``%`` of a name, a
    comparison of a name the loop rebinds, or such a name alone when it reads like a step flag
    (``should_step``, ``is_accumulation_boundary``). No calls other than len(). ``strict``: the
    comparison must not be with None (``x is None`` tests the data, not the step)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "len"):
            return False
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    varying = names & loop.varying
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            if any(isinstance(n, (ast.Name, ast.Attribute)) for n in ast.walk(node)):
                return True
        if isinstance(node, ast.Compare) and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & loop.varying:
            against_none = any(isinstance(c, ast.Constant) and c.value is None for c in (node.left, *node.comparators))
            if not (strict and against_none):
                return True
    bare = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else test
    return isinstance(bare, ast.Name) and bool(varying) and any(w in bare.id.lower() for w in _BOUNDARY_WORDS)


def at_boundary(path: tuple, loop: Loop) -> bool:
    """Whether ``path`` passes, inside ``loop``, an ``if`` that holds only on some iterations."""
    inside = path[path.index(loop) + 1 :] if loop in path else ()
    return any(isinstance(p, Branch) and p.test is not None and boundary_test(p.test, loop) for p in inside)


def _guarded_after(event: Event, loop: Loop, jumps: list[Event]) -> bool:
    """Whether an earlier ``continue``/``return`` in ``loop``, under a boundary test (or under
    no test at all), leaves ``event`` to run on the boundary iterations only."""
    for jump in jumps:
        if jump.order >= event.order or jump.frames[-1] != loop.frame:
            continue  # later, or a return from a helper called in the loop: not the loop's own jump
        inside = jump.path[jump.path.index(loop) + 1 :] if loop in jump.path else ()
        tests = [p.test for p in inside if isinstance(p, Branch) and p.test is not None]
        if not tests or any(boundary_test(t, loop, strict=True) for t in tests):
            return True
    return False


class Accumulation:
    """The micro-batch rules of one function's events (``fc``: its FunctionChecks)."""

    def __init__(self, fc):
        self.fc = fc
        self.jumps, self.backs, self.zeros = defaultdict(list), defaultdict(list), defaultdict(list)
        for kind, index in (("jump", self.jumps), ("backward", self.backs), ("zero_grad", self.zeros)):
            for e in fc.of(kind):
                for lp in e.loops:
                    index[lp].append(e)

    def every_iteration(self, event: Event, loop: Loop) -> bool:
        return not at_boundary(event.path, loop) and not _guarded_after(event, loop, self.jumps.get(loop, []))

    def micro_batch_loop(self, event: Event, root: str | None = None) -> Loop | None:
        """The innermost loop around ``event`` (not a loop over optimizers) with a backward() on
        every iteration, when ``event`` itself runs on every iteration of it."""
        loops = [lp for lp in event.loops if root is None or root not in lp.targets]
        if not loops:
            return None
        loop = loops[-1]
        if not self.every_iteration(event, loop):
            return None
        if not any(self.every_iteration(b, loop) for b in self.backs.get(loop, ())):
            return None
        if any(self.every_iteration(z, loop) and not exclusive_either(z, event) for z in self.zeros.get(loop, ())):
            return None  # gradients zeroed on every iteration: nothing accumulates
        return loop

    def run(self) -> None:
        self.unscale_per_micro_batch()
        self.update_per_micro_batch()
        self.clip_per_micro_batch()

    def unscale_per_micro_batch(self) -> None:  # MP114
        fc = self.fc
        for unscale in fc.of("unscale"):
            if not fc.live(unscale.scaler):
                continue
            loop = self.micro_batch_loop(unscale, (unscale.target or "").split(".")[0])
            if loop is None:
                continue
            updates = fc.of("update", unscale.scaler)
            inside = [u for u in updates if loop in u.path and not exclusive_either(unscale, u)]
            if inside:
                if not all(at_boundary(u.path, loop) for u in inside):
                    continue
                update, where = inside[0], "only at the accumulation boundary"
            else:
                after = [u for u in updates if u.order > unscale.order and not exclusive_either(unscale, u)]
                steps = [e for e in fc.of("scaler_step", unscale.scaler) if loop in e.path]
                if not after or steps or any(loop in u.path for u in updates):
                    continue
                update, where = after[0], "after the micro-batch loop"
            fc.hit(
                "MP114",
                place(unscale, update),
                f"{show(unscale.scaler)}.unscale_({show(unscale.target)}) on every micro-batch, but "
                f"{show(unscale.scaler)}.update() runs {where} (line {update.line}): the second micro-batch "
                f"raises RuntimeError{_via(unscale)}",
            )

    def update_per_micro_batch(self) -> None:  # MP116
        fc = self.fc
        for update in fc.of("update"):
            if not fc.live(update.scaler):
                continue
            loop = self.micro_batch_loop(update)
            if loop is None:
                continue
            steps = [s for s in fc.of("scaler_step", update.scaler) if loop in s.path]
            if not steps or not all(at_boundary(s.path, loop) or not self.every_iteration(s, loop) for s in steps):
                continue
            unscales = [u for u in fc.of("unscale", update.scaler) if loop in u.path and self.every_iteration(u, loop)]
            if unscales:
                continue  # an unscale_ on every micro-batch records inf checks: MP114's case, not this
            fc.hit(
                "MP116",
                place(update, steps[0]),
                f"{show(update.scaler)}.update() on every micro-batch, but {show(update.scaler)}.step() only at the "
                f"accumulation boundary (line {steps[0].line}): update() finds no inf checks on the micro-batches "
                f"in between and raises AssertionError{_via(update)}",
            )

    def clip_per_micro_batch(self) -> None:  # MP118
        fc = self.fc
        steps = [*fc.of("opt_step"), *fc.of("scaler_step")]
        for clip in fc.of("clip"):
            loop = self.micro_batch_loop(clip)
            if loop is None:
                continue
            steps_here = [s for s in steps if loop in s.path and not exclusive_either(clip, s)]
            bounded = [s for s in steps_here if not self.every_iteration(s, loop)]
            if not bounded or any(self.every_iteration(s, loop) for s in steps_here):
                continue
            fc.hit(
                "MP118",
                place(clip, bounded[0]),
                f"gradients clipped on every micro-batch, but the optimizer steps only at the accumulation "
                f"boundary (line {bounded[0].line}): each clip cuts a partial sum of the step's gradients"
                f"{_via(clip)}",
            )
