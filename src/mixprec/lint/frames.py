"""A function body being walked by ``flow``, and the calls it can follow into.

The analysed function is the first frame; each call ``flow`` follows (a function of the file or
of the project, a method through ``self``, a method or ``__call__`` of an object built from a
project class) gets a frame of its own, with its parameters bound to what the caller passed.
``key`` gives a name in the analysed function's terms; ``origin`` the file and local name where
the object was made, which is where its facts are (``scaler = GradScaler(enabled=amp)`` in
main, not ``scaler`` received by ``train_one_epoch``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from mixprec.lint.names import Script, key_of
from mixprec.lint.workspace import Definition


@dataclass
class Frame:
    """One function body being walked (the analysed one, or an inlined call)."""

    id: int
    site: ast.Call | None
    script: Script
    parent: Frame | None = None
    # parameter -> (its key in the analysed function's terms, the caller's local key of the argument)
    binding: dict[str, tuple[str, str]] = field(default_factory=dict)
    local: frozenset[str] = frozenset()  # names the body binds (its locals), empty for the analysed frame
    losses: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (kind, scaler)
    stack: tuple[int, ...] = ()  # ids of the function defs being walked (no recursion)
    chain: tuple[int, ...] = ()  # frame ids from the analysed function to this one
    root: Script | None = None  # the analysed file

    def key(self, k: str | None) -> str | None:
        """``k`` in the analysed function's terms: a parameter replaced by what was passed, a
        local of a helper tagged with its frame, a global of another file with its file."""
        if k is None:
            return None
        root, dot, rest = k.partition(".")
        if root in self.binding:
            return self.binding[root][0] + dot + rest
        if self.parent is None:
            return k
        if root in self.local:
            return f"{root}@{self.id}{dot}{rest}"
        if self.script is not self.root:
            return f"{root}@g{id(self.script) % 1_000_000}{dot}{rest}"
        return k

    def origin(self, k: str) -> tuple[Script, str]:
        """(file, local key) where the object ``k`` names here was bound."""
        frame = self
        while True:
            root, dot, rest = k.partition(".")
            if root not in frame.binding or frame.parent is None:
                return frame.script, k
            k = frame.binding[root][1] + dot + rest
            frame = frame.parent

    def lineage(self, k: str):
        """(file, local key) for ``k`` here and in each caller it was passed from."""
        frame = self
        while frame is not None:
            yield frame.script, k
            root, dot, rest = k.partition(".")
            if root not in frame.binding or frame.parent is None:
                return
            k = frame.binding[root][1] + dot + rest
            frame = frame.parent


def locals_of(func: ast.FunctionDef | ast.AsyncFunctionDef) -> frozenset[str]:
    """Parameters and names a function binds (not those it declares global/nonlocal)."""
    a = func.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
    escaped: set[str] = set()
    todo = list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            escaped.update(node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        if not isinstance(node, ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return frozenset(names - escaped)


def params(func) -> list[str]:
    a = func.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def callee(call: ast.Call, frame: Frame):
    """(def, its Script, key of the object bound to ``self`` in the caller or None) for a call
    that ``flow`` can follow; None when it cannot see the callee, and for a generator (a
    ``@contextmanager``'s body does not run at the call)."""
    found = _callee(call, frame)
    if found is None:
        return None
    project = frame.script.project
    memo = project.memo if project is not None else {}
    key = ("generator", id(found[0]))
    if key not in memo:  # asked once per def, whatever calls it
        memo[key] = _yields(found[0])
    return None if memo[key] else found


def _yields(func) -> bool:
    todo = list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _callee(call: ast.Call, frame: Frame):
    script, func = frame.script, call.func
    if isinstance(func, ast.Name) and func.id not in script.aliases and func.id not in script.relative:
        defs = script.functions.get(func.id, [])
        if len(defs) == 1:
            return defs[0], script, None
        if func.id in script.classes or defs:
            return None
    elif isinstance(func, ast.Attribute) and key_of(func.value) in ("self", "cls"):
        defs = script.methods.get(func.attr, [])
        return (defs[0], script, key_of(func.value)) if len(defs) == 1 else None
    project = script.project
    if project is None:
        return None
    if isinstance(func, (ast.Name, ast.Attribute)):
        found = project.definition(script, func)
        if found is not None:
            return None if found.is_class else (found.node, found.script, None)
    # a method (or __call__) of an object the project's class built: loss_scaler(loss, opt)
    receiver, method = (func.value, func.attr) if isinstance(func, ast.Attribute) else (func, "__call__")
    k = key_of(receiver)
    if k is None or k in ("self", "cls"):
        return None
    home, local = frame.origin(k)
    built = home.assigns.get(local, [])
    if len(built) != 1 or not isinstance(built[0], ast.Call):
        return None
    cls = _class(home, built[0].func)
    if cls is None:
        return None
    node = cls.method(method)
    return (node, cls.script, k) if node is not None else None


def _class(script: Script, func: ast.AST) -> Definition | None:
    if isinstance(func, ast.Name) and func.id in script.classes and func.id not in script.aliases:
        return Definition(script.classes[func.id], script)
    if script.project is None or not isinstance(func, (ast.Name, ast.Attribute)):
        return None
    found = script.project.definition(script, func)
    return found if found is not None and found.is_class else None
