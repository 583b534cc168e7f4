"""MP119: an inf/NaN check per parameter that waits for the device once per tensor.

``for p in model.parameters(): if not torch.isfinite(p.grad).all(): ...`` reads one bool from
the device for each parameter tensor, every step. Found in any loop whose body turns
``isfinite``/``isnan``/``isinf`` of the loop variable's ``.grad`` into a Python value: an
``if``/``while``/``assert`` test, a conditional expression, ``.item()``, ``bool()``, ``float()``,
``int()``; and ``any(...)`` / ``all(...)`` over a generator of such checks. A loop in an
``except`` block (a diagnosis after an overflow) or under an ``if`` on a ``%`` (a logging round)
does not run every step and is left alone. A check that stays a tensor (``flags.append(torch.isfinite(p.grad).all())``, then one
``torch.stack(flags).all()`` after the loop) is not reported.
"""

from __future__ import annotations

import ast

from mixprec.lint.names import Script
from mixprec.lint.report import Hit

_CHECKS = frozenset({"isfinite", "isnan", "isinf", "isposinf", "isneginf"})
_TO_PYTHON = frozenset({"item", "bool", "float", "int", "tolist"})


def _walk(node: ast.AST):
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)


def _grad_check(node: ast.AST, targets: set[str]) -> ast.Call | None:
    """The ``isfinite(t.grad)`` / ``t.grad.isnan()`` call inside ``node`` on a loop variable."""
    for n in _walk(node):
        if not isinstance(n, ast.Call):
            continue
        func = n.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in _CHECKS:
            continue
        checked = [*n.args, func.value] if isinstance(func, ast.Attribute) else list(n.args)
        for arg in checked:
            for m in ast.walk(arg):
                if isinstance(m, ast.Attribute) and m.attr == "grad" and isinstance(m.value, ast.Name) and m.value.id in targets:
                    return n
    return None


def _occasional(script: Script, node: ast.AST) -> bool:
    """Inside an ``except`` block (runs after a failure) or under an ``if`` on a ``%`` (every
    n-th step, a logging round): not every step."""
    current = script.parent(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        if isinstance(current, ast.ExceptHandler):
            return True
        if isinstance(current, ast.If) and any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(current.test)):
            return True
        current = script.parent(current)
    return False


def sync_hits(script: Script) -> list[Hit]:  # MP119
    hits = []
    for loop in script.nodes:
        if isinstance(loop, ast.Call) and getattr(loop.func, "id", "") in ("any", "all") and loop.args \
                and isinstance(loop.args[0], ast.GeneratorExp) and not _occasional(script, loop):
            gen = loop.args[0]  # any(not torch.isfinite(p.grad).all() for p in params): a sync per element
            targets = {n.id for c in gen.generators for n in ast.walk(c.target) if isinstance(n, ast.Name)}
            found = _grad_check(gen.elt, targets)
            if found is not None:
                hits.append(_hit(found))
            continue
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or _occasional(script, loop):
            continue
        targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        found = None
        for stmt in loop.body:
            for node in _walk(stmt):
                tests = []
                if isinstance(node, (ast.If, ast.While, ast.Assert, ast.IfExp)):
                    tests.append(node.test)
                elif isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name in _TO_PYTHON:
                        tests.extend([*node.args, func.value] if isinstance(func, ast.Attribute) else node.args)
                elif isinstance(node, ast.BoolOp):
                    tests.extend(node.values)
                for test in tests:
                    found = found or _grad_check(test, targets)
                if found:
                    break
            if found:
                break
        if found is not None:
            hits.append(_hit(found))
    return hits


def _hit(found: ast.Call) -> Hit:
    return Hit(
        "MP119", found,
        f"{ast.unparse(found)} is read on the host once per parameter: a device sync for every tensor, "
        f"every step; check all gradients at once (one sync) or leave it to the GradScaler",
    )
