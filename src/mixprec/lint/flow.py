"""The training step as a sequence of events, read from one function body.

Rules about order ("unscale_ before the clip") need to know what happens before what, inside
which autocast region, in which loop and on which branch. This module walks a function (or the
module's top level) statement by statement and records the calls that matter as ``Event``s:

    backward, clip, unscale, scaler_step, update, opt_step, autocast (entering a region),
    loss_call (a sensitive custom loss), escape (a scaler handed to code we cannot see),
    jump (a continue, break or return: what follows it may not run on every iteration)

A call to a function defined in the same file is followed (inlined, three levels deep), with
its parameters bound to the caller's arguments, so a loop split across a function and a loop
body reads as one step. Every inlined event remembers the call in the analysed function that
led to it (``site``): a finding that lies wholly inside one helper is left to that helper's own
analysis, and one that involves the caller is reported at the call.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field

from mixprec.lint.losses import SensitiveLosses
from mixprec.lint.dtypes import Autocast
from mixprec.lint.dtypes import autocast as autocast_of
from mixprec.lint.names import CLIPS, Script, key_of, scale_receiver

_MAX_DEPTH = 3  # helper calls followed below the analysed function
_GUARD_WORDS = ("inf", "finite", "nan", "overflow")


@dataclass(frozen=True)
class Region:
    """An autocast region in force; ``site`` as for events."""

    autocast: Autocast
    site: ast.Call | None


@dataclass(frozen=True)
class Branch:
    """One arm of an if/try/match. ``ends`` says how the arm leaves when its last statement
    does ("return", "raise", "loop" for continue/break); ``guard`` that the test looks like a
    manual inf check."""

    node_id: int
    arm: int
    ends: str | None
    guard: bool
    frame: int
    cond: tuple[str, bool] | None = None  # an ``if`` arm: (stable test, whether it holds here)
    test: ast.expr | None = field(default=None, compare=False, hash=False)  # an ``if`` arm's test


@dataclass(frozen=True)
class Loop:
    node_id: int
    targets: frozenset[str]
    frame: int
    # names that change from one iteration to the next: the targets and the names the body binds
    varying: frozenset[str] = field(default=frozenset(), compare=False, hash=False)


@dataclass
class Event:
    kind: str
    node: ast.AST
    ctx: tuple[Region, ...]
    path: tuple[Branch | Loop, ...]
    site: ast.Call | None
    frames: tuple[int, ...]
    order: int
    scaler: str | None = None  # the GradScaler involved (key in the analysed function's terms)
    target: str | None = None  # the optimizer stepped or unscaled
    loss: str = "plain"  # for backward: "scaled", "plain" or "unknown"
    name: str | None = None  # for loss_call: the loss's name
    sensitivity: object = None  # for loss_call: where the loss is 16-bit-sensitive (losses.Sensitivity)

    @property
    def region(self) -> Region | None:
        """The innermost autocast region, when it is (or may be) enabled."""
        if not self.ctx or self.ctx[-1].autocast.enabled is False:
            return None
        return self.ctx[-1]

    @property
    def loops(self) -> tuple[Loop, ...]:
        return tuple(p for p in self.path if isinstance(p, Loop))


@dataclass
class _Frame:
    """One function body being walked (the analysed one, or an inlined call)."""

    id: int
    site: ast.Call | None
    binding: dict[str, str] = field(default_factory=dict)  # parameter -> caller's key
    losses: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (kind, scaler)
    stack: tuple[int, ...] = ()  # ids of the function defs being walked (no recursion)
    chain: tuple[int, ...] = ()  # frame ids from the analysed function to this one

    def key(self, k: str | None) -> str | None:
        """A key in the analysed function's terms: a parameter replaced by what was passed."""
        if k is None:
            return None
        root, _, rest = k.partition(".")
        if root in self.binding:
            return self.binding[root] + ("." + rest if rest else "")
        return k


def exclusive(a: Event, b: Event) -> bool:
    """True when ``a`` (earlier) and ``b`` cannot both run in one pass: other arms of one
    if/try/match, or ``a`` sits in an arm that returns, raises or continues before ``b``."""
    for pa, pb in zip(a.path, b.path):
        if pa == pb:
            continue
        if isinstance(pa, Branch) and isinstance(pb, Branch) and pa.node_id == pb.node_id and pa.frame == pb.frame:
            return True
        break
    for i, element in enumerate(a.path):
        if not isinstance(element, Branch) or not element.ends or element in b.path:
            continue
        if element.ends == "raise":
            return True
        if element.ends == "return" and element.frame in b.frames:
            return True
        if element.ends == "loop":
            loop = next((p for p in reversed(a.path[:i]) if isinstance(p, Loop)), None)
            if loop is not None and loop in b.path:
                return True
    return False


def opposite_arms(a: Event, b: Event) -> bool:
    """True when ``a`` and ``b`` sit in arms of ``if`` statements whose (stable) tests disagree:
    ``if amp: <a>`` and, later, ``if amp: ... else: <b>`` never run in one pass."""
    conds = {(p.frame, p.cond) for p in a.path if isinstance(p, Branch) and p.cond is not None}
    return any(
        (p.frame, (p.cond[0], not p.cond[1])) in conds for p in b.path if isinstance(p, Branch) and p.cond is not None
    )


class Flow:
    """Builds the events of each function in a file."""

    def __init__(self, script: Script):
        self.script = script
        self.losses = SensitiveLosses(script)
        self._ids = itertools.count(1)
        self._calls: dict[int, list[ast.Call]] = {}  # statement -> its calls in order (reused when inlining)
        self._assigns: dict[int, list[ast.Assign]] = {}  # body -> its single-name assignments

    def function(self, func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module) -> list[Event]:
        """The events of ``func`` (a module means its top-level code)."""
        self.events: list[Event] = []
        self._order = itertools.count()
        frame = _Frame(id=next(self._ids), site=None)
        frame.chain = (frame.id,)
        ctx: tuple[Region, ...] = ()
        if isinstance(func, ast.Module):
            frame.losses = self._local_losses(func.body, frame)
        else:
            frame.stack = (id(func),)
            frame.losses = {a: ("unknown", None) for a in _params(func)}
            frame.losses.update(self._local_losses(func.body, frame))
            ctx = self._decorators(func, None)
        self._block(func.body, frame, ctx, ())
        return self.events

    # --- statements ------------------------------------------------------------------------

    def _block(self, stmts, frame: _Frame, ctx, path) -> None:
        for stmt in stmts:
            self._stmt(stmt, frame, ctx, path)

    def _stmt(self, stmt: ast.stmt, frame: _Frame, ctx, path) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # analysed on their own
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            inner = ctx
            for item in stmt.items:
                self._expr(item.context_expr, frame, inner, path)
                autocast = autocast_of(self.script, item.context_expr)
                if autocast is not None:
                    inner = inner + (Region(autocast, frame.site),)
                    self._emit("autocast", item.context_expr, frame, inner, path)
            self._block(stmt.body, frame, inner, path)
        elif isinstance(stmt, ast.If):
            self._expr(stmt.test, frame, ctx, path)
            guard = self._is_guard(stmt.test)
            cond = self.script.condition(stmt.test)
            for arm, body in enumerate((stmt.body, stmt.orelse)):
                holds = None if cond is None else (cond[0], cond[1] == (arm == 0))
                branch = Branch(id(stmt), arm, _ends(body), guard, frame.id, holds, stmt.test)
                self._block(body, frame, ctx, path + (branch,))
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            targets: frozenset[str] = frozenset()
            stored = frozenset(
                n.id
                for part in stmt.body
                for n in _walk_no_lambda(part)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
            if isinstance(stmt, ast.While):
                inner_path = path + (Loop(id(stmt), targets, frame.id, stored),)
                self._expr(stmt.test, frame, ctx, inner_path)
            else:
                self._expr(stmt.iter, frame, ctx, path)
                targets = frozenset(n.id for n in ast.walk(stmt.target) if isinstance(n, ast.Name))
                inner_path = path + (Loop(id(stmt), targets, frame.id, targets | stored),)
            self._block(stmt.body, frame, ctx, inner_path)
            self._block(stmt.orelse, frame, ctx, path)
        elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            self._block(stmt.body, frame, ctx, path)
            for arm, handler in enumerate(stmt.handlers, start=1):
                branch = Branch(id(stmt), arm, _ends(handler.body), False, frame.id)
                self._block(handler.body, frame, ctx, path + (branch,))
            self._block(stmt.orelse, frame, ctx, path)
            self._block(stmt.finalbody, frame, ctx, path)
        elif isinstance(stmt, ast.Match):
            self._expr(stmt.subject, frame, ctx, path)
            for arm, case in enumerate(stmt.cases):
                branch = Branch(id(stmt), arm, _ends(case.body), False, frame.id)
                self._block(case.body, frame, ctx, path + (branch,))
        else:
            self._expr(stmt, frame, ctx, path)
            if isinstance(stmt, (ast.Continue, ast.Break, ast.Return)):
                self._emit("jump", stmt, frame, ctx, path)

    def _is_guard(self, test: ast.expr) -> bool:
        for node in ast.walk(test):
            k = key_of(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
            text = k or (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "")
            if any(word in text.lower() for word in _GUARD_WORDS) or self.script.is_scaler(k):
                return True
        return False

    # --- calls -----------------------------------------------------------------------------

    def _expr(self, node: ast.AST, frame: _Frame, ctx, path) -> None:
        """The calls in one statement or expression, in the order they finish."""
        calls = self._calls.get(id(node))
        if calls is None:
            calls = [n for n in _walk_no_lambda(node) if isinstance(n, ast.Call)]
            calls.sort(key=lambda c: (c.end_lineno or 0, c.end_col_offset or 0))
            self._calls[id(node)] = calls
        for call in calls:
            self._call(call, frame, ctx, path)

    def _call(self, call: ast.Call, frame: _Frame, ctx, path) -> None:
        script, func = self.script, call.func
        loss_name = self.losses.name_of(call)
        if loss_name is not None:
            self._emit("loss_call", call, frame, ctx, path, name=loss_name,
                       sensitivity=self.losses.sensitivity.get(loss_name))
        if isinstance(func, ast.Attribute):
            local = key_of(func.value)
            receiver = frame.key(local)
            first = frame.key(key_of(call.args[0])) if call.args else None
            if func.attr == "backward" and not call.args:
                kind, scaler = self._classify(func.value, frame)
                self._emit("backward", call, frame, ctx, path, scaler=scaler, loss=kind)
                return
            if script.is_scaler(local) or script.is_scaler(receiver):
                kinds = {"unscale_": "unscale", "step": "scaler_step", "update": "update"}
                if func.attr == "update" and (call.args or call.keywords):
                    return  # update(new_scale) sets the scale: no inf checks, no second update
                if func.attr in kinds:
                    self._emit(kinds[func.attr], call, frame, ctx, path, scaler=receiver, target=first)
                return
            if func.attr == "step" and (script.is_optimizer(local) or script.is_optimizer(receiver)):
                self._emit("opt_step", call, frame, ctx, path, target=receiver)
                return
        qualname = script.qualname(func)
        if qualname in CLIPS:
            self._emit("clip", call, frame, ctx, path)
            return
        if qualname == "torch.autograd.backward" and call.args:
            kind, scaler = self._classify(call.args[0], frame)
            self._emit("backward", call, frame, ctx, path, scaler=scaler, loss=kind)
            return
        callee = self._callee(call)
        if callee is not None and id(callee) not in frame.stack and len(frame.chain) <= _MAX_DEPTH:
            self._inline(call, callee, frame, ctx, path)
            return
        self._escapes(call, frame, ctx, path)

    def _escapes(self, call: ast.Call, frame: _Frame, ctx, path) -> None:
        """A scaler passed to code we cannot read might be stepped or updated there."""
        for arg in itertools.chain(call.args, (kw.value for kw in call.keywords)):
            k = frame.key(key_of(arg.value if isinstance(arg, ast.Starred) else arg))
            if self.script.is_scaler(k) or k == "self":
                self._emit("escape", call, frame, ctx, path, scaler=k)
        func = call.func
        if isinstance(func, ast.Attribute) and key_of(func.value) == "self":
            self._emit("escape", call, frame, ctx, path, scaler="self")

    def _callee(self, call: ast.Call):
        func = call.func
        if isinstance(func, ast.Name) and func.id not in self.script.aliases:
            defs = self.script.functions.get(func.id, [])
        elif isinstance(func, ast.Attribute) and key_of(func.value) in ("self", "cls"):
            defs = self.script.methods.get(func.attr, [])
        else:
            return None
        return defs[0] if len(defs) == 1 else None

    def _inline(self, call: ast.Call, callee, frame: _Frame, ctx, path) -> None:
        inner = _Frame(id=next(self._ids), site=frame.site or call, stack=frame.stack + (id(callee),))
        inner.chain = frame.chain + (inner.id,)
        params = _params(callee)
        if isinstance(call.func, ast.Attribute) and params:
            params = params[1:]  # self / cls
        bound: dict[str, ast.expr] = dict(zip(params, call.args))
        bound.update((kw.arg, kw.value) for kw in call.keywords if kw.arg in params)
        if isinstance(call.func, ast.Attribute):
            inner.binding["self"] = frame.key("self") or "self"
        for name in params:
            arg = bound.get(name)
            passed = frame.key(key_of(arg)) if arg is not None else None
            if passed is not None:
                inner.binding[name] = passed
            inner.losses[name] = self._classify(arg, frame) if arg is not None else ("unknown", None)
        inner.losses.update(self._local_losses(callee.body, inner))
        ctx = ctx + self._decorators(callee, inner.site)
        self._block(callee.body, inner, ctx, path)

    def _decorators(self, func, site) -> tuple[Region, ...]:
        regions = (autocast_of(self.script, d) for d in func.decorator_list)
        return tuple(Region(r, site) for r in regions if r is not None)

    # --- what a backward() runs on ---------------------------------------------------------

    def _classify(self, expr: ast.AST, frame: _Frame) -> tuple[str, str | None]:
        """("scaled", scaler) when ``expr`` is (or was computed from) ``scaler.scale(...)``;
        ("unknown", None) when it involves a parameter or a hand-made product (manual scaling);
        ("plain", None) otherwise."""
        for node in _walk_no_lambda(expr):
            if isinstance(node, ast.Call):
                local = scale_receiver(node)
                if self.script.is_scaler(local) or self.script.is_scaler(frame.key(local)):
                    return "scaled", frame.key(local)
        kinds = [frame.losses[n.id] for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in frame.losses]
        for kind in ("scaled", "unknown"):
            for found in kinds:
                if found[0] == kind:
                    return found
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
            return "unknown", None
        return "plain", None

    def _local_losses(self, body, frame: _Frame) -> dict[str, tuple[str, str | None]]:
        """Names assigned a scaled loss in this body (``scaled = scaler.scale(loss)``)."""
        assigns = self._assigns.get(id(body))
        if assigns is None:
            assigns = [
                node
                for stmt in body
                for node in _walk_no_lambda(stmt)
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            ]
            self._assigns[id(body)] = assigns
        found: dict[str, tuple[str, str | None]] = {}
        for node in assigns:
            kind = self._classify(node.value, frame)
            if kind[0] == "scaled":
                found[node.targets[0].id] = kind
        return found

    def _emit(self, kind: str, node: ast.AST, frame: _Frame, ctx, path, **fields) -> None:
        self.events.append(
            Event(kind, node, ctx, path, frame.site, frame.chain, next(self._order), **fields)
        )


def _params(func) -> list[str]:
    a = func.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _ends(body: list[ast.stmt]) -> str | None:
    if not body:
        return None
    tail = body[-1]
    if isinstance(tail, ast.Return):
        return "return"
    if isinstance(tail, ast.Raise):
        return "raise"
    if isinstance(tail, (ast.Continue, ast.Break)):
        return "loop"
    return None


def _walk_no_lambda(node: ast.AST):
    """ast.walk that does not enter lambdas or nested definitions (they run elsewhere)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.append(child)
