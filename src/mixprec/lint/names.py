"""What the names in a script refer to, found from its text alone.

A rule asks "is this call torch.autocast?" or "is ``self.scaler`` a GradScaler?"; this module
answers from the file's imports (``import torch.amp as amp``, ``from torch.cuda.amp import
autocast as ac``) and its assignments (``self.scaler = GradScaler()``). When it cannot tell, it
says so (``None``), and the rules then stay silent rather than guess.

A *key* is the dotted text of a plain name chain: ``scaler``, ``self.scaler``, ``trainer.opt``.
"""

from __future__ import annotations

import ast
import re

# Spellings of one object -> the one name the rules use.
_CANONICAL = {
    "torch.amp.autocast": "torch.autocast",
    "torch.amp.autocast_mode.autocast": "torch.autocast",
    "torch.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
    "torch.cuda.amp.autocast_mode.autocast": "torch.cuda.amp.autocast",
    "torch.cuda.amp.grad_scaler.GradScaler": "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.autocast_mode.autocast": "torch.cpu.amp.autocast",
    "torch.cpu.amp.grad_scaler.GradScaler": "torch.cpu.amp.GradScaler",
    "mixprec.scaling.GradScaler": "mixprec.GradScaler",
    "mixprec.scaling.scaler.GradScaler": "mixprec.GradScaler",
    "torch.half": "torch.float16",
    "torch.float": "torch.float32",
    "torch.double": "torch.float64",
    "torch.nn.utils.clip_grad.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    "torch.nn.utils.clip_grad.clip_grad_value_": "torch.nn.utils.clip_grad_value_",
    "torch.nn.utils.clip_grad.clip_grad_norm": "torch.nn.utils.clip_grad_norm",
}

# autocast constructor -> (positional parameter names, device when fixed by the API)
AUTOCASTS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "torch.autocast": (("device_type", "dtype", "enabled", "cache_enabled"), None),
    "torch.cuda.amp.autocast": (("enabled", "dtype", "cache_enabled"), "cuda"),
    "torch.cpu.amp.autocast": (("enabled", "dtype", "cache_enabled"), "cpu"),
}
# GradScaler constructor -> positional index of ``enabled``
SCALERS: dict[str, int] = {
    "torch.amp.GradScaler": 5,
    "mixprec.GradScaler": 5,
    "torch.cuda.amp.GradScaler": 4,
    "torch.cpu.amp.GradScaler": 4,
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler": 5,
}
CLIPS = frozenset(
    {
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.utils.clip_grad_value_",
        "torch.nn.utils.clip_grad_norm",
    }
)
DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float64": "fp64"}

# opt, optim, optimizer, optimiser, alone or as a word of a snake/digit name: g_opt, optimizer2
_OPTIMIZER_NAME = re.compile(r"(^|_)(opt|optim|optimizer|optimiser)s?\d*(_|$)|optimi[sz]er$", re.I)
_SCALER_METHODS = frozenset({"step", "update", "scale", "unscale_", "get_scale"})
_MIXED_PRECISION = frozenset({"mixprec.MixedPrecision", "mixprec.training.MixedPrecision"})


def key_of(node: ast.AST | None) -> str | None:
    """``self.scaler`` for ``self.scaler``; None for anything that is not a plain name chain."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = key_of(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def last(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def argument(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument passed for parameter ``name`` (positional ``index``), or None."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return None


class Script:
    """Facts about one parsed file that every rule shares."""

    def __init__(self, tree: ast.Module, star_aliases: dict[str, str] | None = None):
        """``star_aliases``: names that ``from module import *`` of the file's own project
        brings in (see ``project``), known only when the file's path is."""
        self.tree = tree
        self.nodes: list[ast.AST] = list(ast.walk(tree))  # walked once; the rules filter this list
        self.aliases: dict[str, str] = {}
        self.module_aliases: dict[str, str] = {}  # imports at module level only
        self.deprecated_shims: set[str] = set()  # names imported from two modules (try/except)
        self.imported_roots: set[str] = set()
        self.assigns: dict[str, list[ast.expr]] = {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.class_methods: dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.calls: list[ast.Call] = []
        self._classdefs: list[ast.ClassDef] = []
        # ``from .x import y as z``: z -> (level, "x", "y"); ``from . import m``: m -> (1, None, "m")
        self.relative: dict[str, tuple[int, str | None, str]] = {}
        self._parents: dict[int, ast.AST] | None = None
        self._scope_stores: dict[int, dict[str, int]] = {}
        self.path = None  # the file, when known (set by the engine); the project resolves imports from it
        self.project = None  # the workspace.Project the file is linted in, or None
        for name, target in (star_aliases or {}).items():  # the file's own imports override these
            self.aliases[name] = self.module_aliases[name] = target
            self.imported_roots.add(target.split(".")[0])
        self._collect()
        self._stores: dict[str, int] = {}  # key -> how many times the file binds or deletes it
        for node in self.nodes:
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                k = key_of(node)
                if k is not None:
                    self._stores[k] = self._stores.get(k, 0) + 1
        self._grad_lines = _line_table(((a, b, mode) for a, b, mode in self._grad_mode_ranges()), self._lines)
        self.scaler_enabled_by_key = self._scaler_constructions()
        self.scaler_keys = set(self.scaler_enabled_by_key) | self._inferred_scalers()
        self.optimizer_keys = self._optimizers()
        self.uses_autocast = any(
            self.qualname(n) in AUTOCASTS for n in self.nodes if isinstance(n, (ast.Name, ast.Attribute))
        )

    # --- collection ------------------------------------------------------------------------

    def _collect(self) -> None:
        seen: dict[str, set[str]] = {}
        module_level = {id(n) for n in _module_statements(self.tree.body)}
        for node in self.nodes:
            if isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    if a.name != "*":
                        self.relative[a.asname or a.name] = (node.level, node.module, a.name)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top = id(node) in module_level
                for name, target in _bindings(node):
                    seen.setdefault(name, set()).add(target)
                    self.aliases[name] = target
                    if top:
                        self.module_aliases[name] = target
                    self.imported_roots.add(target.split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    k = key_of(target)
                    if k is not None:
                        self.assigns.setdefault(k, []).append(node.value)
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                self._classdefs.append(node)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.methods.setdefault(item.name, []).append(item)
                        self.class_methods.setdefault(node.name, {})[item.name] = item
            elif isinstance(node, ast.Call):
                self.calls.append(node)
        methods = {id(m) for ms in self.methods.values() for m in ms}
        for node in self.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
                self.functions.setdefault(node.name, []).append(node)
        self._defs = [f for fs in (*self.functions.values(), *self.methods.values()) for f in fs]
        # line -> the innermost def / class around it: owner() in constant time, so that rules
        # asking it for every call stay linear in the file's length
        self._lines = max((getattr(n, "end_lineno", 0) or 0 for n in self.tree.body), default=0) + 2
        self._def_lines = _line_table(((f.lineno, f.end_lineno, f) for f in self._defs), self._lines)
        self._class_lines = _line_table(((c.lineno, c.end_lineno, c) for c in self._classdefs), self._lines)
        for name, targets in seen.items():
            if len({canonical(t) for t in targets}) > 1:
                self.deprecated_shims.add(name)
        # A name the file also defines or assigns is not reliably the imported object (an
        # ``except ImportError: torch = None`` fallback does not count).
        for name in list(self.aliases):
            rebound = [v for v in self.assigns.get(name, []) if not (isinstance(v, ast.Constant) and v.value is None)]
            if name in self.functions or name in self.classes or rebound:
                del self.aliases[name]
                self.module_aliases.pop(name, None)

    def _scaler_constructions(self) -> dict[str, bool | None]:
        """key -> enabled (True, False, or None when run-time or constructed more than one way)."""
        found: dict[str, set[bool | None]] = {}
        self.scaler_sites: dict[str, list[ast.Call]] = {}
        for k, values in self.assigns.items():
            for value in values:
                if isinstance(value, ast.Call) and self.qualname(value.func) in SCALERS:
                    index = SCALERS[self.qualname(value.func)]
                    found.setdefault(k, set()).add(self.constant(argument(value, index, "enabled"), True))
                    self.scaler_sites.setdefault(k, []).append(value)
        return {k: (v.pop() if len(v) == 1 else None) for k, v in found.items()}

    def _inferred_scalers(self) -> set[str]:
        """Receivers used the way only a GradScaler is: ``x.unscale_(...)``,
        ``x.scale(loss).backward()``, or a ``*scaler*`` name stepped (with an optimizer) or updated."""
        keys: set[str] = set()
        mixed = self._mixed_precision_keys()
        for call in self.calls:
            func = call.func
            if not isinstance(func, ast.Attribute):
                continue
            k = key_of(func.value)
            if k in mixed:
                continue  # a MixedPrecision: its step() is the whole step, its unscale_() one part of it
            if func.attr == "unscale_" and k:
                keys.add(k)
            elif func.attr in _SCALER_METHODS and k and "scaler" in last(k).lower():
                if func.attr == "step" and not call.args:
                    continue  # GradScaler.step takes the optimizer: ``lr_scaler.step()`` is a schedule
                keys.add(k)
            elif func.attr == "backward":
                keys.update(s for s in (scale_receiver(c) for c in _calls_in(func.value)) if s)
        return keys

    def _mixed_precision_keys(self) -> set[str]:
        """Receivers that are a ``mixprec.MixedPrecision``: built from it in this file, or used with
        a method only it has (``prepare``, ``after_backward``, ``optimizer_step``)."""
        keys = {k for k, values in self.assigns.items()
                if any(isinstance(v, ast.Call) and self.qualname(v.func) in _MIXED_PRECISION for v in values)}
        for call in self.calls:
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr in ("prepare", "after_backward", "optimizer_step"):
                k = key_of(func.value)
                if k:
                    keys.add(k)
        return keys

    def _optimizers(self) -> set[str]:
        keys = set()
        for k, values in self.assigns.items():
            if any(isinstance(v, ast.Call) and self.is_optimizer_class(v.func) for v in values):
                keys.add(k)
        for call in self.calls:
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr in ("step", "unscale_") and call.args:
                if key_of(func.value) in self.scaler_keys and key_of(call.args[0]):
                    keys.add(key_of(call.args[0]))
        return keys

    # --- questions -------------------------------------------------------------------------

    def qualname(self, node: ast.AST) -> str | None:
        """``torch.autocast`` for ``amp.autocast`` after ``import torch.amp as amp``."""
        if isinstance(node, ast.Name):
            target = self.aliases.get(node.id)
            return canonical(target) if target else None
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return canonical(f"{base}.{node.attr}") if base else None
        return None

    def single_value(self, node: ast.AST) -> ast.expr | None:
        """The one value a plain name is ever assigned in this file, else None."""
        k = key_of(node)
        values = self.assigns.get(k, []) if k else []
        return values[0] if len(values) == 1 else None

    def constant(self, node: ast.AST | None, default=None, _depth: int = 0):
        """A literal (or a name assigned one literal once); ``default`` when absent; else None."""
        if node is None:
            return default
        if isinstance(node, ast.Constant):
            return node.value
        value = self.single_value(node)
        if value is not None and _depth < 3:
            return self.constant(value, None, _depth + 1)
        return None

    def condition(self, test: ast.expr) -> tuple[str, bool] | None:
        """(key, polarity) for an ``if`` test that reads the same value wherever it appears:
        names and attributes the file binds at most once, constants, comparisons and
        and/or/not; ``not x`` and ``x is not None`` give the key of ``x`` / ``x is None`` with
        the opposite polarity. None for anything else (a call, a subscript, a name rebound)."""
        original = test
        test, positive = normalized_test(test)
        for node in ast.walk(test):
            if isinstance(node, (ast.Name, ast.Attribute)):
                k = key_of(node)
                if k is None:
                    return None
                parts = k.split(".")
                if self._local_stores(original).get(parts[0], 0) > 1:
                    return None  # a local name rebound in its function
                if any(self._stores.get(".".join(parts[:i]), 0) > 1 for i in range(2, len(parts) + 1)):
                    return None
            elif not isinstance(
                node, (ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.expr_context, ast.boolop, ast.cmpop, ast.unaryop)
            ):
                return None
        return ast.dump(test), positive

    def _local_stores(self, node: ast.AST) -> dict[str, int]:
        """name -> how many times the function around ``node`` (or the module's top level)
        binds it, nested functions left out."""
        owner = self.owner(node)
        found = self._scope_stores.get(id(owner))
        if found is None:
            found = self._scope_stores[id(owner)] = {}
            todo = list((owner or self.tree).body)
            while todo:
                current = todo.pop()
                if isinstance(current, ast.Name) and isinstance(current.ctx, (ast.Store, ast.Del)):
                    found[current.id] = found.get(current.id, 0) + 1
                for child in ast.iter_child_nodes(current):
                    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                        todo.append(child)
        return found

    def is_optimizer_class(self, func: ast.AST) -> bool:
        q = self.qualname(func) or ""
        return (q.startswith("torch.optim.") or ".optim." in q or ".optimizers." in q) and not any(
            word in q for word in ("lr_scheduler", "swa_utils")
        )

    def is_scaler(self, k: str | None) -> bool:
        return k is not None and k in self.scaler_keys

    def is_optimizer(self, k: str | None) -> bool:
        if k is None or k in self.scaler_keys:
            return False
        name = last(k)
        return k in self.optimizer_keys or (
            bool(_OPTIMIZER_NAME.search(name)) and "sched" not in name.lower()
        )

    def scaler_enabled(self, k: str | None) -> bool | None:
        """True/False when every construction of ``k`` says so literally; None otherwise."""
        return self.scaler_enabled_by_key.get(k) if k else None

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The node ``node`` is a child of (the map is built on the first question)."""
        if self._parents is None:
            self._parents = {id(c): n for n in self.nodes for c in ast.iter_child_nodes(n)}
        return self._parents.get(id(node))

    def store_count(self, k: str) -> int:
        """How many times the file binds (or deletes) ``k``: assignments, loop targets, ``as`` names..."""
        return self._stores.get(k, 0)

    def _grad_mode(self, expr: ast.AST) -> bool | None:
        """False for ``torch.no_grad()``, ``torch.inference_mode()`` (or ``(True)``) and
        ``torch.set_grad_enabled(False)``; True for ``torch.enable_grad()`` and
        ``set_grad_enabled(True)``; None for anything else (a mode read at run time included)."""
        call = expr if isinstance(expr, ast.Call) else None
        q = self.qualname(call.func if call is not None else expr) or ""
        q = q.replace("torch.autograd.grad_mode.", "torch.").replace("torch.autograd.", "torch.")
        arg = None
        if call is not None and (call.args or call.keywords):
            arg = self.constant(call.args[0] if call.args else call.keywords[0].value, None)
        if q == "torch.no_grad":
            return False
        if q == "torch.enable_grad":
            return True
        if q == "torch.inference_mode":
            return False if (call is None or not (call.args or call.keywords) or arg is True) else None
        if q == "torch.set_grad_enabled" and call is not None and isinstance(arg, bool):
            return arg
        return None

    def _grad_mode_ranges(self) -> list[tuple[int, int, bool]]:
        """(first line, last line, grad enabled) of every ``with`` body and decorated function
        that sets the grad mode."""
        ranges = []
        for node in self.nodes:
            if isinstance(node, (ast.With, ast.AsyncWith)) and node.body:
                for item in node.items:
                    mode = self._grad_mode(item.context_expr)
                    if mode is not None:  # from the with line: ``with torch.no_grad(), autocast(...)``
                        ranges.append((node.lineno, node.end_lineno, mode))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    mode = self._grad_mode(dec)
                    if mode is not None:
                        ranges.append((node.body[0].lineno, node.end_lineno, mode))
        return ranges

    def without_grad(self, node: ast.AST) -> bool:
        """Whether ``node`` runs with gradients off for certain: inside ``with torch.no_grad():``
        (or ``inference_mode``, ``set_grad_enabled(False)``) or a function decorated with one,
        and no ``enable_grad`` closer in."""
        line = getattr(node, "lineno", None)
        return line is not None and line < len(self._grad_lines) and self._grad_lines[line] is False

    def owner(self, node: ast.AST, kinds=(ast.FunctionDef, ast.AsyncFunctionDef)) -> ast.AST | None:
        """The innermost definition of ``kinds`` whose lines contain ``node``; None at module level."""
        line = getattr(node, "lineno", None)
        table = self._class_lines if kinds is ast.ClassDef else self._def_lines
        if line is None or line >= len(table):
            return None
        return table[line]

    def same_scope(self, a: ast.AST, b: ast.AST, k: str) -> bool:
        """Whether ``k`` at ``a`` and at ``b`` can be one object: one function (or both at module
        level), or, for ``self.*``, two methods of one class."""
        if self.owner(a) is self.owner(b):
            return True
        return k.startswith("self.") and self.owner(a, ast.ClassDef) is self.owner(b, ast.ClassDef) is not None

    def torch_name(self) -> str | None:
        """A module-level name bound to the ``torch`` module itself (for rewrites)."""
        for name, target in self.module_aliases.items():
            if target == "torch" and self.aliases.get(name) == "torch":
                return name
        return None


def normalized_test(test: ast.expr) -> tuple[ast.expr, bool]:
    """(test, polarity) with leading ``not`` and ``is not``/``!=`` folded into the polarity."""
    positive = True
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, positive = test.operand, not positive
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.IsNot, ast.NotEq)):
        op = ast.Is() if isinstance(test.ops[0], ast.IsNot) else ast.Eq()
        test, positive = ast.Compare(left=test.left, ops=[op], comparators=test.comparators), not positive
    return test, positive


def _line_table(ranges, size: int) -> list:
    """[line] -> the value of the innermost (first line, last line, value) range holding that
    line (None where none does). Ranges nest or are disjoint; of two starting on one line the
    shorter is the inner one."""
    table: list = [None] * size
    for first, last_line, value in sorted(ranges, key=lambda r: (r[0], -r[1])):
        table[first : last_line + 1] = [value] * (last_line + 1 - first)
    return table


# ``from torch.cuda.amp import *`` binds its ``__all__``: without it GradScaler and autocast were
# unknown names there, and MP201 missed the deprecated import (found by a probe of real scripts)
TORCH_STAR_EXPORTS = {
    "torch.cuda.amp": ("autocast", "GradScaler", "custom_fwd", "custom_bwd"),
    "torch.cpu.amp": ("autocast", "GradScaler"),
}


def canonical(name: str) -> str:
    return _CANONICAL.get(name, name)


def scale_receiver(call: ast.Call) -> str | None:
    """``scaler`` for the call ``scaler.scale(loss)``; None for other calls."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "scale" and len(call.args) == 1:
        return key_of(func.value)
    return None


def _calls_in(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _module_statements(body: list[ast.stmt]):
    """Statements that run at import time: the module body and the blocks of its if/try/with,
    each statement before the blocks it holds (body, orelse, finalbody, then the handlers).

    A stack of iterators, not recursion: an ``elif`` chain is an ``If`` nested in the one
    before's ``orelse``, and a 1,000-branch chain at module level (valid Python) overflowed the
    interpreter's stack (found by a probe of real scripts)."""
    stack = [iter(body)]
    while stack:
        stmt = next(stack[-1], None)
        if stmt is None:
            stack.pop()
            continue
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        blocks = [getattr(stmt, f, []) for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(stmt, "handlers", [])]
        stack.append(iter([s for block in blocks for s in block]))


def _bindings(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(local name, qualified name) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        out = []
        for alias in node.names:
            if alias.asname:
                out.append((alias.asname, alias.name))
            else:  # ``import torch.cuda.amp`` binds ``torch``
                root = alias.name.split(".")[0]
                out.append((root, root))
        return out
    if node.level or not node.module:
        return []
    out = [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
    if any(a.name == "*" for a in node.names):  # torch's own ``__all__``: known without importing it
        out += [(name, f"{node.module}.{name}") for name in TORCH_STAR_EXPORTS.get(canonical(node.module), ())]
    return out
