"""The training step as a sequence of events, read from one function body.

Rules about order ("unscale_ before the clip") need to know what happens before what, inside
which autocast region, in which loop and on which branch. This module walks a function (or the
module's top level) statement by statement and records the calls that matter as ``Event``s
(see ``events``):

    backward, clip, unscale, scaler_step, update, opt_step, sched_step, autocast (entering a
    region), loss_call (a sensitive custom loss), escape (a scaler handed to code we cannot
    see), jump (a continue, break or return: what follows it may not run on every iteration),
    skip_check (the scale read back after a step, to see whether it was skipped), zero_grad,
    accel_unscale (``accelerator.unscale_gradients()``); an autocast region is entered by a ``with``,
    ``stack.enter_context(...)`` or ``ctx.__enter__()``

A call the walk can see into is followed (inlined, three levels deep), with its parameters bound
to the caller's arguments, so a loop split across functions reads as one step: a function of
the same file or, through its imports, of the project (see ``workspace``), a method through
``self``, a method or ``__call__`` of an object built from a class of the project. Every inlined
event remembers the call in the analysed function that led to it (``site``): a finding that lies
wholly inside one helper is left to that helper's own analysis, and one that involves the caller
is reported at the call.
"""

from __future__ import annotations

import ast
import itertools

from mixprec.lint.dtypes import autocast as autocast_of
from mixprec.lint.dtypes import accelerator_precisions, autocast_for_key, is_accelerator, values
from mixprec.lint.events import Branch, Event, Loop, Region
from mixprec.lint.frames import Frame, callee, locals_of, params
from mixprec.lint.losses import SensitiveLosses
from mixprec.lint.names import CLIPS, Script, key_of, normalized_test, scale_receiver

_MAX_DEPTH = 3  # helper calls followed below the analysed function
_GUARD_WORDS = ("inf", "finite", "nan", "overflow")
_SCHEDULER_WORDS = ("sched", "lr_policy")


class Flow:
    """Builds the events of each function in a file."""

    def __init__(self, script: Script):
        self.script = script
        self._losses: dict[int, SensitiveLosses] = {}
        self._ids = itertools.count(1)
        self._calls: dict[int, list[ast.Call]] = {}  # statement -> its calls in order (reused when inlining)
        self._assigns: dict[int, list[ast.Assign]] = {}  # body -> its single-name assignments
        self._locals: dict[int, frozenset[str]] = {}
        self._stored: dict[int, frozenset[str]] = {}  # loop -> the names its body binds
        self._parts: dict[int, tuple[list[str], list[str]]] = {}  # expression -> (scale receivers, names)
        # key in the analysed function's terms -> (file, local key) where the object was made
        self.origins: dict[str, tuple[Script, str]] = {}

    def function(self, func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module) -> list[Event]:
        """The events of ``func`` (a module means its top-level code)."""
        self.events: list[Event] = []
        self._order = itertools.count()
        frame = Frame(id=next(self._ids), site=None, script=self.script, root=self.script)
        frame.chain = (frame.id,)
        ctx: tuple[Region, ...] = ()
        if isinstance(func, ast.Module):
            frame.losses = self._local_losses(func.body, frame)
        else:
            frame.stack = (id(func),)
            frame.losses = {a: ("unknown", None) for a in params(func)}
            frame.losses.update(self._local_losses(func.body, frame))
            ctx = self._decorators(func, frame)
        self._block(func.body, frame, ctx, ())
        return self.events

    # --- facts about names, wherever they were bound ---------------------------------------

    def losses_of(self, script: Script) -> SensitiveLosses:
        found = self._losses.get(id(script))
        if found is None:
            found = self._losses[id(script)] = SensitiveLosses(script)
        return found

    def is_scaler(self, frame: Frame, k: str | None) -> bool:
        return k is not None and any(s.is_scaler(local) for s, local in frame.lineage(k))

    def is_optimizer(self, frame: Frame, k: str | None) -> bool:
        return k is not None and any(s.is_optimizer(local) for s, local in frame.lineage(k))

    def _remember(self, frame: Frame, local: str | None) -> str | None:
        """``local`` in the analysed function's terms, noting where the object was made."""
        mapped = frame.key(local)
        if mapped is not None and local is not None and mapped not in self.origins:
            self.origins[mapped] = frame.origin(local)
        return mapped

    def _autocast(self, frame: Frame, expr: ast.expr):
        """(the autocast ``with expr`` enters or None, whether it came from a caller's argument)."""
        found = autocast_of(frame.script, expr)
        if found is not None or frame.parent is None:
            return found, False
        target = expr.func if isinstance(expr, ast.Call) else expr
        k = key_of(target)
        if k is None or k.partition(".")[0] not in frame.binding:
            return None, False
        home, local = frame.origin(k)  # ``amp_autocast`` passed in by the caller
        return autocast_for_key(home, local, expr), True

    def _accelerator(self, frame: Frame, receiver: ast.expr) -> bool:
        """An Accelerate ``Accelerator``: a name that says so, or one built as one."""
        k = key_of(receiver)
        if k is None:
            return False
        home, bound, _ = self._bound(frame, receiver, k)
        return "accelerator" in k.lower() or is_accelerator(home, bound)

    def _precisions(self, frame: Frame, receiver: ast.expr) -> frozenset | None:
        """The ``mixed_precision`` values the Accelerator ``receiver`` may be built with (see
        ``dtypes.accelerator_precisions``); one received from a caller is looked up where it was
        made, and must be built alike wherever its name is bound there."""
        k = key_of(receiver)
        if k is None:
            return None
        home, bound, inherited = self._bound(frame, receiver, k)
        found = accelerator_precisions(home, bound)
        return None if inherited and found is not None and len(found) != 1 else found

    @staticmethod
    def _bound(frame: Frame, receiver: ast.expr, k: str):
        """(file, the values ``receiver`` may hold there, whether it came from a caller)."""
        home, local = frame.origin(k)
        if home is frame.script and local == k:
            return home, values(home, receiver), False
        return home, home.assigns.get(local), True

    # --- statements ------------------------------------------------------------------------

    def _block(self, stmts, frame: Frame, ctx, path) -> None:
        opened: list[tuple[str | None, Region]] = []  # regions entered by a call in this block
        for stmt in stmts:
            self._stmt(stmt, frame, ctx, path)
            call = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            entered = self._entered(call, frame)
            if entered is not None:
                owner, expr, region = entered
                opened.append((owner, region))
                ctx = ctx + (region,)
                self._emit("autocast", expr, frame, ctx, path)
            elif opened and call.func.attr in ("__exit__", "close"):
                owner = key_of(call.func.value)
                closed = [r for k, r in opened if k is not None and k == owner]
                opened = [(k, r) for k, r in opened if k is None or k != owner]
                ctx = tuple(r for r in ctx if r not in closed)

    def _entered(self, call: ast.Call, frame: Frame):
        """(the key whose ``__exit__()``/``close()`` ends it, the autocast expression, the region)
        for an autocast entered by a call rather than a ``with``: ``stack.enter_context(autocast)``
        of a ``contextlib.ExitStack``, ``ctx.__enter__()`` (the rest of the block runs in it)."""
        func = call.func
        if func.attr == "enter_context" and len(call.args) == 1:
            owner, expr = key_of(func.value), call.args[0]
        elif func.attr == "__enter__" and not call.args:
            owner, expr = key_of(func.value), func.value
        else:
            return None
        autocast, inherited = self._autocast(frame, expr)
        if autocast is None:
            return None
        return owner, expr, Region(autocast, None if inherited else frame.site)

    def _stmt(self, stmt: ast.stmt, frame: Frame, ctx, path) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # analysed on their own
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            inner = ctx
            for item in stmt.items:
                self._expr(item.context_expr, frame, inner, path)
                autocast, inherited = self._autocast(frame, item.context_expr)
                if autocast is not None:
                    # a factory the caller passed in: the helper alone cannot see the region
                    inner = inner + (Region(autocast, None if inherited else frame.site),)
                    self._emit("autocast", item.context_expr, frame, inner, path)
            self._block(stmt.body, frame, inner, path)
        elif isinstance(stmt, ast.If):
            while True:  # an elif chain (``orelse == [If]``) in a loop: thousands of arms, no recursion
                self._expr(stmt.test, frame, ctx, path)
                guard = self._is_guard(stmt.test, frame)
                cond = self._condition(stmt.test, frame)
                arms = []
                for arm, body in enumerate((stmt.body, stmt.orelse)):
                    holds = None if cond is None else (cond[0], cond[1] == (arm == 0))
                    arms.append(path + (Branch(id(stmt), arm, _ends(body), guard, frame.id, holds, stmt.test),))
                self._block(stmt.body, frame, ctx, arms[0])
                path = arms[1]
                if len(stmt.orelse) != 1 or not isinstance(stmt.orelse[0], ast.If):
                    self._block(stmt.orelse, frame, ctx, path)
                    break
                stmt = stmt.orelse[0]
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            targets: frozenset[str] = frozenset()
            stored = self._stored.get(id(stmt))
            if stored is None:
                stored = self._stored[id(stmt)] = frozenset(
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
                names = [n.id for n in ast.walk(stmt.target) if isinstance(n, ast.Name)]
                targets = frozenset(frame.key(n) for n in names)
                inner_path = path + (Loop(id(stmt), targets, frame.id, frozenset(names) | stored),)
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

    def _condition(self, test: ast.expr, frame: Frame) -> tuple[str, bool] | None:
        """(stable ``if`` test, polarity) in the analysed function's terms (a flag passed to a
        helper is the caller's flag), or None."""
        found = frame.script.condition(test)
        if found is None:
            return None
        text, positive = found
        node, _ = normalized_test(test)
        names = ",".join(frame.key(n.id) or n.id for n in ast.walk(node) if isinstance(n, ast.Name))
        return f"{text}|{names}", positive

    def _is_guard(self, test: ast.expr, frame: Frame) -> bool:
        for node in ast.walk(test):
            k = key_of(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
            text = k or (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "")
            if any(word in text.lower() for word in _GUARD_WORDS) or self.is_scaler(frame, k):
                return True
        return False

    # --- calls -----------------------------------------------------------------------------

    def _expr(self, node: ast.AST, frame: Frame, ctx, path) -> None:
        """The calls in one statement or expression, in the order they finish."""
        calls = self._calls.get(id(node))
        if calls is None:
            calls = [n for n in _walk_no_lambda(node) if isinstance(n, ast.Call)]
            calls.sort(key=lambda c: (c.end_lineno or 0, c.end_col_offset or 0))
            self._calls[id(node)] = calls
        for call in calls:
            self._call(call, frame, ctx, path)

    def _call(self, call: ast.Call, frame: Frame, ctx, path) -> None:
        script, func = frame.script, call.func
        losses = self.losses_of(script)
        loss_name = losses.name_of(call)
        if loss_name is not None:
            self._emit("loss_call", call, frame, ctx, path, name=loss_name, sensitivity=losses.sensitivity.get(loss_name))
        if isinstance(func, ast.Attribute):
            local = key_of(func.value)
            first = key_of(call.args[0]) if call.args else None
            if func.attr == "backward" and not call.args:
                kind, scaler = self._classify(func.value, frame)
                self._emit("backward", call, frame, ctx, path, scaler=scaler, loss=kind)
                return
            if func.attr in ("backward", "unscale_gradients") and self._accelerator(frame, func.value):
                if func.attr == "backward" and call.args:  # Accelerate scales it itself
                    self._emit("backward", call, frame, ctx, path, loss="managed", target=self._remember(frame, local),
                               precisions=self._precisions(frame, func.value))
                    return
                if func.attr == "unscale_gradients":
                    self._emit("accel_unscale", call, frame, ctx, path, target=self._remember(frame, local))
                    return
            if func.attr == "unscale_" and local and local.endswith(".scaler") and self._accelerator(frame, func.value.value):
                self._emit("accel_unscale", call, frame, ctx, path, target=self._remember(frame, local))  # accelerator.scaler
            if self.is_scaler(frame, local):
                kinds = {"unscale_": "unscale", "step": "scaler_step", "update": "update", "get_scale": "skip_check"}
                if func.attr == "update" and (call.args or call.keywords):
                    return  # update(new_scale) sets the scale: no inf checks, no second update
                if func.attr in kinds:
                    receiver = self._remember(frame, local)
                    self._emit(kinds[func.attr], call, frame, ctx, path, scaler=receiver, target=self._remember(frame, first))
                return
            if func.attr == "zero_grad":
                self._emit("zero_grad", call, frame, ctx, path, target=self._remember(frame, local))
                return
            if func.attr == "step" and self.is_optimizer(frame, local):
                self._emit("opt_step", call, frame, ctx, path, target=self._remember(frame, local))
                return
            if func.attr == "step" and local and any(w in local.rsplit(".", 1)[-1].lower() for w in _SCHEDULER_WORDS) \
                    and not call.args:  # step(val_loss), step(epoch): a plateau or epoch schedule, not per step
                self._emit("sched_step", call, frame, ctx, path, target=self._remember(frame, local))
                return
        qualname = script.qualname(func)
        if qualname in CLIPS:
            self._emit("clip", call, frame, ctx, path)
            return
        if qualname == "torch.autograd.backward" and call.args:
            kind, scaler = self._classify(call.args[0], frame)
            self._emit("backward", call, frame, ctx, path, scaler=scaler, loss=kind)
            return
        found = callee(call, frame) if len(frame.chain) <= _MAX_DEPTH else None
        if found is not None and id(found[0]) not in frame.stack:
            self._inline(call, found, frame, ctx, path)
            return
        self._escapes(call, frame, ctx, path)

    def _escapes(self, call: ast.Call, frame: Frame, ctx, path) -> None:
        """A scaler passed to code we cannot read might be stepped or updated there."""
        for arg in itertools.chain(call.args, (kw.value for kw in call.keywords)):
            local = key_of(arg.value if isinstance(arg, ast.Starred) else arg)
            if self.is_scaler(frame, local) or local == "self":
                self._emit("escape", call, frame, ctx, path, scaler=self._remember(frame, local))
        func = call.func
        if isinstance(func, ast.Attribute) and key_of(func.value) == "self":
            self._emit("escape", call, frame, ctx, path, scaler=frame.key("self"))
        called = key_of(func)
        if called and "scaler" in called.rsplit(".", 1)[-1].lower():  # loss_scaler(loss, optimizer): timm's NativeScaler
            self._emit("escape", call, frame, ctx, path, scaler=self._remember(frame, called))

    def _inline(self, call: ast.Call, found, frame: Frame, ctx, path) -> None:
        node, script, receiver = found
        inner = Frame(
            id=next(self._ids), site=frame.site or call, script=script, parent=frame,
            stack=frame.stack + (id(node),), root=self.script,
        )
        inner.chain = frame.chain + (inner.id,)
        inner.local = self._locals.get(id(node)) or self._locals.setdefault(id(node), locals_of(node))
        names = params(node)
        if receiver is not None and names:
            names = names[1:]  # self / cls
            inner.binding[node.args.args[0].arg if node.args.args else "self"] = (frame.key(receiver), receiver)
        bound: dict[str, ast.expr] = dict(zip(names, call.args))
        bound.update((kw.arg, kw.value) for kw in call.keywords if kw.arg in names)
        for name in names:
            arg = bound.get(name)
            local = key_of(arg) if arg is not None else None
            if local is not None:
                inner.binding[name] = (frame.key(local), local)
            inner.losses[name] = self._classify(arg, frame) if arg is not None else ("unknown", None)
        inner.losses.update(self._local_losses(node.body, inner))
        ctx = ctx + self._decorators(node, inner)
        self._block(node.body, inner, ctx, path)

    def _decorators(self, func, frame: Frame) -> tuple[Region, ...]:
        regions = (autocast_of(frame.script, d) for d in func.decorator_list)
        return tuple(Region(r, frame.site) for r in regions if r is not None)

    # --- what a backward() runs on ---------------------------------------------------------

    def _classify(self, expr: ast.AST, frame: Frame) -> tuple[str, str | None]:
        """("scaled", scaler) when ``expr`` is (or was computed from) ``scaler.scale(...)``;
        ("unknown", None) when it involves a parameter or a hand-made product (manual scaling);
        ("plain", None) otherwise."""
        parts = self._parts.get(id(expr))
        if parts is None:
            nodes = list(_walk_no_lambda(expr))
            receivers = [r for r in (scale_receiver(n) for n in nodes if isinstance(n, ast.Call)) if r]
            parts = self._parts[id(expr)] = (receivers, [n.id for n in nodes if isinstance(n, ast.Name)])
        for local in parts[0]:
            if self.is_scaler(frame, local):
                return "scaled", self._remember(frame, local)
        kinds = [frame.losses[n] for n in parts[1] if n in frame.losses]
        for kind in ("scaled", "unknown"):
            for found in kinds:
                if found[0] == kind:
                    return found
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
            return "unknown", None
        return "plain", None

    def _local_losses(self, body, frame: Frame) -> dict[str, tuple[str, str | None]]:
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

    def _emit(self, kind: str, node: ast.AST, frame: Frame, ctx, path, **fields) -> None:
        self.events.append(
            Event(kind, node, ctx, path, frame.site, frame.chain, next(self._order), script=frame.script, **fields)
        )


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
