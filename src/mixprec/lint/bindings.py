"""Which assignment of a local name reaches a given statement, along the code path.

A checkpoint variable is often bound several times in one function: the loaded checkpoint of a
resume branch, ``None`` to free memory, then the dict that is saved (and ``del``-eted after).
What ``torch.save(ckpt, ...)`` saves is the binding that reaches that call, not every binding
of the name. ``Bindings`` walks one scope (a function body, or the module's top level) in
order and records, before each statement, the values each local name may hold there:

    ckpt = torch.load(path)        # {torch.load(path)}
    ckpt = None                    # {None}
    for epoch in range(n):
        ckpt = {"model": ...}      # {None, {"model": ...}} before it (a second iteration)
        torch.save(ckpt, path)     # {{"model": ...}}: only the dict reaches the save
        del ckpt

Branches merge (an ``if`` without ``else`` keeps the value from before it), loops run to a
fixed point, an arm that returns or raises contributes nothing after it. A binding the module
cannot see through (a parameter, a loop target, tuple unpacking, ``+=``, ``with ... as``, an
import, a walrus) is ``UNKNOWN``; a name declared ``global``/``nonlocal`` is never resolved.
The answer errs towards "cannot tell" (``None``), never towards a value that cannot be there.

``names`` limits the walk to the names a rule will ask about, and ``window`` to the top-level
statements where those names occur (nothing before the first binds them, nothing after the last
reads them): a module's top level binds thousands of names, and carrying all of them through
every statement would make the walk quadratic in the module's length. ``ScopeBindings`` builds
one such walk per group of names, when it is first asked about.
"""

from __future__ import annotations

import ast

UNKNOWN = "<unknown>"  # a value bound the linter cannot see

State = dict  # name -> frozenset of value nodes (or UNKNOWN); None: the point is unreachable
_MAX_PASSES = 6  # loop fixed point: the value sets only grow, and they are small


def _merge(*states):
    live = [s for s in states if s is not None]
    if not live:
        return None
    out: dict = {}
    for state in live:
        for name, values in state.items():
            out[name] = out.get(name, frozenset()) | values
    return out


def _walk_scope(node: ast.AST):
    """The nodes of one statement or expression, not entering nested functions, classes or
    lambdas (their names are another scope)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)


def _target_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


class Bindings:
    """The values each local name of one scope may hold before each of its statements."""

    def __init__(self, scope: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module, names=None, window=None):
        """``names``: the only names tracked (a set), or None for all of them. ``window``:
        (first, last) index of the top-level statements of ``scope`` to walk, which must hold
        every occurrence of the tracked names; None for all."""
        self.names = None if names is None else frozenset(names)
        self.before: dict[int, State] = {}  # statement id -> state before it
        self.stmt_of: dict[int, ast.stmt] = {}  # node id -> the statement it belongs to
        self.origin: dict[int, ast.stmt] = {}  # assigned value id -> its assignment statement
        self.escaped: set[str] = set()  # global / nonlocal names
        self.local: set[str] = set()  # names bound anywhere in the scope
        self._loops: list[list] = []  # per enclosing loop: states at its continue/break
        start: State = {}
        if not isinstance(scope, ast.Module):
            a = scope.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and self._tracked(arg.arg):
                    start[arg.arg] = frozenset({UNKNOWN})
                    self.local.add(arg.arg)
        first, last = window if window is not None else (0, len(scope.body) - 1)
        self._block(scope.body[first : last + 1], start)

    # --- questions -------------------------------------------------------------------------

    def values(self, name: str, node: ast.AST) -> list[ast.expr] | None:
        """The values ``name`` may hold where ``node`` (an expression of this scope) runs:
        [] when the name is not bound in this scope (a global, a builtin), None when it
        cannot be told (a binding not seen through, or ``node`` unreachable or unknown, or a
        name not tracked)."""
        if name in self.escaped or not self._tracked(name):
            return None
        if name not in self.local:
            return []
        stmt = self.stmt_of.get(id(node))
        state = self.before.get(id(stmt)) if stmt is not None else None
        if state is None or name not in state:
            return None
        found = state[name]
        if UNKNOWN in found:
            return None
        return sorted(found, key=lambda v: (v.lineno, v.col_offset))

    def statement(self, node: ast.AST) -> ast.stmt | None:
        return self.stmt_of.get(id(node))

    def _tracked(self, name: str) -> bool:
        return self.names is None or name in self.names

    # --- the walk --------------------------------------------------------------------------

    def _enter(self, stmt: ast.stmt, state: State, *headers: ast.AST) -> None:
        self.before[id(stmt)] = state
        self.stmt_of[id(stmt)] = stmt
        for header in headers:
            if header is None:
                continue
            for node in _walk_scope(header):
                self.stmt_of[id(node)] = stmt

    def _bind(self, state: State, names, value=UNKNOWN) -> State:
        names = [n for n in names if self._tracked(n)]
        if not names:
            return state  # states are never changed in place: sharing it is safe
        state = dict(state)
        for name in names:
            self.local.add(name)
            state[name] = frozenset({value})
        return state

    def _walrus(self, state: State, *parts: ast.AST) -> State:
        names = [
            n.target.id
            for part in parts
            if part is not None
            for n in _walk_scope(part)
            if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)
        ]
        return self._bind(state, names) if names else state

    def _block(self, stmts: list[ast.stmt], state: State | None) -> State | None:
        for stmt in stmts:
            if state is None:
                return None  # the rest of the block is unreachable
            state = self._stmt(stmt, state)
        return state

    def _assign(self, stmt: ast.stmt, state: State) -> State:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        else:
            targets, value = [stmt.target], stmt.value
        state = self._walrus(state, value)
        for target in targets:
            if isinstance(target, ast.Name):
                if value is None or not self._tracked(target.id):  # ``x: int``: a declaration, no binding
                    continue
                self.origin[id(value)] = stmt
                state = self._bind(state, [target.id], value)
            elif isinstance(target, (ast.Tuple, ast.List)):
                state = self._bind(state, _target_names(target))
        return state

    def _stmt(self, stmt: ast.stmt, state: State) -> State | None:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            self._enter(stmt, state, stmt)
            return self._assign(stmt, state)
        if isinstance(stmt, ast.AugAssign):
            self._enter(stmt, state, stmt)
            return self._bind(self._walrus(state, stmt.value), _target_names(stmt.target) if isinstance(stmt.target, ast.Name) else [])
        if isinstance(stmt, ast.Delete):
            self._enter(stmt, state, stmt)
            state = dict(state)
            for target in stmt.targets:
                if isinstance(target, ast.Name) and self._tracked(target.id):
                    self.local.add(target.id)
                    state.pop(target.id, None)
            return state
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            self._enter(stmt, state, stmt)
            names = [(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"]
            return self._bind(state, names)
        if isinstance(stmt, (ast.Global, ast.Nonlocal)):
            self._enter(stmt, state)
            self.escaped.update(stmt.names)
            return state
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._enter(stmt, state, *getattr(stmt, "decorator_list", []))
            return self._bind(state, [stmt.name])
        if isinstance(stmt, (ast.Return, ast.Raise)):
            self._enter(stmt, state, stmt)
            return None
        if isinstance(stmt, (ast.Continue, ast.Break)):
            self._enter(stmt, state)
            if self._loops:
                self._loops[-1].append(state)
            return None
        if isinstance(stmt, ast.If):
            self._enter(stmt, state, stmt.test)
            state = self._walrus(state, stmt.test)
            return _merge(self._block(stmt.body, state), self._block(stmt.orelse, state))
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            return self._loop(stmt, state)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            self._enter(stmt, state, *(i.context_expr for i in stmt.items), *(i.optional_vars for i in stmt.items))
            state = self._walrus(state, *(i.context_expr for i in stmt.items))
            names = [n for i in stmt.items if i.optional_vars is not None for n in _target_names(i.optional_vars)]
            return self._block(stmt.body, self._bind(state, names))
        if isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            return self._try(stmt, state)
        if isinstance(stmt, ast.Match):
            self._enter(stmt, state, stmt.subject)
            state = self._walrus(state, stmt.subject)
            outs = [state]  # no case matched
            for case in stmt.cases:
                names = [
                    n.name for n in ast.walk(case.pattern) if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name
                ] + [n.rest for n in ast.walk(case.pattern) if isinstance(n, ast.MatchMapping) and n.rest]
                outs.append(self._block(case.body, self._bind(state, names)))
            return _merge(*outs)
        self._enter(stmt, state, stmt)  # Expr, Assert, Pass, ...
        return self._walrus(state, stmt)

    def _loop(self, stmt, state: State) -> State | None:
        is_for = not isinstance(stmt, ast.While)
        header = stmt.iter if is_for else stmt.test
        if is_for:
            state = self._walrus(state, stmt.iter)
        targets = _target_names(stmt.target) if is_for else []
        head = state
        for _ in range(_MAX_PASSES):
            self._enter(stmt, head, header, *( [stmt.target] if is_for else []))
            self._loops.append([])
            inner = self._bind(head, targets) if is_for else self._walrus(head, stmt.test)
            body_out = self._block(stmt.body, inner)
            jumps = self._loops.pop()
            again = _merge(head, body_out, *jumps)
            if again == head:
                break
            head = again
        # ``head`` holds the state before the first iteration and after each one; the loop's
        # continue/break states count as exits too (an over-approximation, never a miss)
        return _merge(self._block(stmt.orelse, head), *jumps)

    def _try(self, stmt, state: State) -> State | None:
        self._enter(stmt, state)
        body_out = self._block(stmt.body, state)
        # a handler may start after any statement of the body: merge every state seen there
        seen = [self.before.get(id(n)) for s in stmt.body for n in ast.walk(s) if isinstance(n, ast.stmt)]
        handler_in = _merge(state, body_out, *seen)
        outs = [self._block(stmt.orelse, body_out)]
        for handler in stmt.handlers:
            bound = self._bind(handler_in, [handler.name]) if handler.name else handler_in
            outs.append(self._block(handler.body, bound))
        if not stmt.finalbody:
            return _merge(*outs)
        after = _merge(*outs)
        final = self._block(stmt.finalbody, _merge(after, handler_in))
        return None if after is None else final


class ScopeBindings:
    """The bindings of one scope, walked per group of names: ``of(name)`` is a ``Bindings``
    that tracks ``name`` and the names ``feeds`` says its values are built from, over the
    top-level statements where any of them occurs."""

    def __init__(self, scope: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module, feeds=None):
        self.scope = scope
        self.feeds: dict[str, set[str]] = feeds or {}
        self._span: dict[str, tuple[int, int]] = {}  # name -> first and last top-level statement
        params = set()
        if not isinstance(scope, ast.Module):
            a = scope.args
            params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
        for index, stmt in enumerate(scope.body):
            for node in _walk_scope(stmt):
                if isinstance(node, ast.Name):
                    names = [node.id]
                elif isinstance(node, (ast.Global, ast.Nonlocal)):
                    names = node.names
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not stmt:
                    names = [node.name]
                else:
                    continue
                for name in names:
                    first, last = self._span.get(name, (0 if name in params else index, index))
                    self._span[name] = (min(first, index), max(last, index))
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first, last = self._span.get(stmt.name, (index, index))
                self._span[stmt.name] = (min(first, index), max(last, index))
        self._walks: dict[frozenset, Bindings] = {}

    def group(self, name: str) -> frozenset:
        out, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in out:
                out.add(current)
                todo.extend(self.feeds.get(current, ()))
        return frozenset(out)

    def of(self, name: str) -> Bindings:
        names = self.group(name)
        found = self._walks.get(names)
        if found is None:
            spans = [self._span[n] for n in names if n in self._span]
            window = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, -1)
            found = self._walks[names] = Bindings(self.scope, names, window)
        return found

    def values(self, name: str, node: ast.AST) -> list[ast.expr] | None:
        return self.of(name).values(name, node)
