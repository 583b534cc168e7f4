"""MP111: a checkpoint with the model's and the optimizer's state but not the GradScaler's.

What reaches ``torch.save`` is judged, as far as the file shows it for certain:

* a dict display or ``dict(...)`` call, directly or through a name: the binding of that name
  that reaches the save along the code path (see ``bindings``), so a name that held the loaded
  checkpoint of a resume branch, or ``None``, earlier in the function does not hide the dict
  that is saved; ``del ckpt`` after the save changes nothing;
* ``{**state, "epoch": e}`` and ``dict(state, epoch=e)`` merges of dicts it can see;
* ``dataclasses.asdict(snapshot)`` (or the object itself) of a dataclass defined in the file;
* a save helper defined in the file, ``def save_checkpoint(state, path): torch.save(state, path)``:
  each call of it is judged as a save of its argument.

It stays silent when the scaler is not in the saving code's scope, when the file saves a
scaler's ``state_dict()`` anywhere, when the saved dict may be changed before the save (an item
assigned, a method called on it, the dict handed to another function), and whenever a binding
on the way cannot be seen through.
"""

from __future__ import annotations

import ast

from mixprec.lint.bindings import Bindings, ScopeBindings, _walk_scope
from mixprec.lint.names import Script, key_of
from mixprec.lint.report import Hit
from mixprec.lint.savers import checkpointer_without_scaler, definition_of, mentions_scaler, saves_in

_READ_ONLY = frozenset({"get", "keys", "values", "items", "copy"})
_HARMLESS = frozenset({"print", "len", "isinstance", "repr", "str", "id", "type", "dict", "sorted", "list"})
_MAX_DEPTH = 5
_MAX_COMBINATIONS = 8


def method_calls(script: Script, method: str) -> list[tuple[str, ast.Call]]:
    """(receiver key, call) for each ``key.method(...)``; every method when ``method`` is empty."""
    out = []
    for call in script.calls:
        func = call.func
        if isinstance(func, ast.Attribute) and method in ("", func.attr) and key_of(func.value):
            out.append((key_of(func.value), call))
    return out


def _params(func) -> list[str]:
    a = func.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


class Checkpoints:
    """The MP111 check of one file."""

    def __init__(self, script: Script):
        self.script = script
        self._bindings: dict[int, ScopeBindings] = {}
        self._sites: dict[int, dict[str, list[tuple[ast.AST, bool]]]] = {}  # scope -> name -> change sites

    # --- scopes ----------------------------------------------------------------------------

    def scope(self, node: ast.AST) -> ast.AST:
        return self.script.owner(node) or self.script.tree

    def bindings(self, node: ast.AST, name: str) -> Bindings:
        """The bindings of ``name`` (and of the names its values are built from) in the scope
        ``node`` is in (or is)."""
        scope = node if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)) else self.scope(node)
        found = self._bindings.get(id(scope))
        if found is None:
            feeds: dict[str, set[str]] = {}
            for n in _walk_scope(scope):
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                    read = {m.id for m in _walk_scope(n.value) if isinstance(m, ast.Name)}
                    for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                        if isinstance(target, ast.Name):
                            feeds.setdefault(target.id, set()).update(read)
            found = self._bindings[id(scope)] = ScopeBindings(scope, feeds)
        return found.of(name)

    def _change_sites(self, scope: ast.AST) -> dict[str, list[tuple[ast.AST, bool]]]:
        """name -> (node, whether it is a call the name is passed to) for each place in the
        scope that may change the dict the name holds; built once per scope."""
        found = self._sites.get(id(scope))
        if found is not None:
            return found
        found = self._sites[id(scope)] = {}
        for node in _walk_scope(scope):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if isinstance(node.value, ast.Name):
                    found.setdefault(node.value.id, []).append((node, False))
            elif isinstance(node, ast.Call):
                func = node.func
                receiver = None
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    receiver = func.value.id
                    if func.attr not in _READ_ONLY:
                        found.setdefault(receiver, []).append((node, False))
                if isinstance(func, ast.Name) and func.id in _HARMLESS:
                    continue
                passed = {
                    inner.id
                    for arg in (*node.args, *(kw.value for kw in node.keywords))
                    for inner in [arg.value if isinstance(arg, ast.Starred) else arg]
                    if isinstance(inner, ast.Name)
                }
                for name in passed:
                    if not (name == receiver and func.attr not in _READ_ONLY):
                        found.setdefault(name, []).append((node, True))
        return found

    # --- what is saved ---------------------------------------------------------------------

    def saves(self) -> list[tuple[ast.Call, ast.expr, str | None]]:
        """(call, saved expression, helper name) for each torch.save and each call of a save helper."""
        script = self.script
        out = []
        helpers: dict[int, tuple[str, int | None, str | None]] = {}  # def id -> (name, position, keyword)
        for call in script.calls:
            if script.qualname(call.func) != "torch.save" or not call.args:
                continue
            first = call.args[0]
            if not isinstance(first, ast.Starred):
                out.append((call, first, None))
            helper = self._helper(call)
            if helper is not None:
                helpers[id(helper[0])] = helper[1:]
        for call in script.calls:
            callee = self._callee(call)
            if callee is not None and id(callee) in helpers:
                name, position, keyword = helpers[id(callee)]
            else:
                helper = self._project_helper(call)
                if helper is None:
                    continue
                name, position, keyword = helper
            arg = next((kw.value for kw in call.keywords if keyword and kw.arg == keyword), None)
            if arg is None and position is not None and position < len(call.args):
                if not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
                    arg = call.args[position]
            if arg is not None:
                out.append((call, arg, name))
        return out

    def _memo(self, kind: str, node: ast.AST, make):
        project = self.script.project
        if project is None:
            return make()
        key = (kind, id(node))
        if key not in project.memo:
            project.memo[key] = make()
        return project.memo[key]

    def _project_helper(self, call: ast.Call):
        """(name, position, keyword) when ``call`` calls a save helper of another file."""
        found = definition_of(self.script, call)
        if found is None or found[1] is self.script:
            return None
        func, home = found

        def make():
            other = Checkpoints(home)
            for save in saves_in(home, func):
                helper = other._helper(save)
                if helper is not None and helper[0] is func:
                    return helper[1:]
            return None

        return self._memo("save-helper", func, make)

    def _writer(self, call: ast.Call) -> str | None:
        """The name of the function ``call`` calls when it is a checkpoint writer (see
        ``savers``): it saves a dict it builds with model and optimizer state, and no scaler."""
        found = definition_of(self.script, call)
        if found is None:
            return None
        func, home = found

        def make():
            if mentions_scaler(home, func):
                return None
            other = Checkpoints(home) if home is not self.script else self
            for save in saves_in(home, func):
                saved = save.args[0]
                if isinstance(saved, ast.Name) and saved.id in _params(func):
                    return None  # a save helper: its caller's dict is judged instead
                dicts = other.resolve(saved)
                if dicts and all(_lacks_scaler_state(home, d) for d in dicts):
                    return func.name
            return None

        return self._memo("writer", func, make)

    def _helper(self, save: ast.Call):
        """(def, name, position at its call sites, keyword) when ``save`` is ``torch.save(p, ...)``
        of a parameter ``p`` of the function around it, which that function never changes."""
        func = self.script.owner(save)
        if func is None:
            return None
        params = _params(func)
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)
        is_method = func in self.script.methods.get(func.name, []) and bool(params) and not static
        offset = 1 if is_method else 0
        first = save.args[0]
        if isinstance(first, ast.Starred):  # def save(*args, **kwargs): torch.save(*args, **kwargs)
            vararg = func.args.vararg
            if not (isinstance(first.value, ast.Name) and vararg is not None and first.value.id == vararg.arg):
                return None
            positional = len(func.args.posonlyargs) + len(func.args.args) - offset
            return (func, func.name, positional, None) if positional == 0 else None
        if not isinstance(first, ast.Name) or first.id not in params or first.id in ("self", "cls"):
            return None
        name = first.id
        rebound = any(
            isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del))
            for n in _walk_scope(func)
        )
        if rebound or self._changed(name, func, {id(save)}):
            return None
        index = params.index(name)
        kwonly = index >= len(func.args.posonlyargs) + len(func.args.args)
        position = None if kwonly else index - offset
        return func, func.name, position, (None if index < len(func.args.posonlyargs) else name)

    def _callee(self, call: ast.Call):
        func, script = call.func, self.script
        if isinstance(func, ast.Name) and func.id not in script.aliases:
            defs = script.functions.get(func.id, [])
        elif isinstance(func, ast.Attribute) and key_of(func.value) in ("self", "cls"):
            defs = script.methods.get(func.attr, [])
        else:
            return None
        return defs[0] if len(defs) == 1 else None

    def _changed(self, name: str, scope: ast.AST, allowed: set[int], saved: set[int] | None = None) -> bool:
        """Whether the dict ``name`` may be changed in ``scope``: an item assigned or deleted, a
        method other than a read called on it, or the dict handed to a call (other than the
        saves in ``allowed`` and a few builtins that only read). With ``saved`` (the ids of the
        dicts that reach the save), only a site where one of them, or a value not seen through,
        may be what ``name`` holds counts: handing the loaded checkpoint of a resume branch to
        a function does not change the dict saved later."""
        bindings = self.bindings(scope, name) if saved is not None else None
        for node, passed in self._change_sites(scope).get(name, ()):
            if passed and id(node) in allowed:
                continue
            if bindings is None:
                return True
            values = bindings.values(name, node)
            if values is None or any(id(v) in saved for v in values):
                return True
        return False

    def resolve(self, expr: ast.AST, depth: int = 0) -> list[dict[ast.AST, ast.AST]] | None:
        """The dicts ``expr`` may be, as {key node: value node}; None when it cannot be told."""
        if depth > _MAX_DEPTH:
            return None
        script = self.script
        if isinstance(expr, ast.Name):
            values = self.bindings(expr, expr.id).values(expr.id, expr)
            if values == []:  # not bound in this scope: the file's one value for it, if any
                single = script.single_value(expr) if self.scope(expr) is not script.tree else None
                values = [single] if single is not None else None
            if not values:
                return None
            dicts = [v for v in values if not (isinstance(v, ast.Constant) and v.value is None)]
            return self._all(dicts, depth) if dicts else None
        if isinstance(expr, ast.Attribute):
            single = script.single_value(expr)
            return self.resolve(single, depth + 1) if single is not None else None
        if isinstance(expr, ast.Dict):
            base = {k: v for k, v in zip(expr.keys, expr.values) if k is not None}
            merged = [self.resolve(v, depth + 1) for k, v in zip(expr.keys, expr.values) if k is None]
            return _combine(base, merged)
        if isinstance(expr, ast.Call):
            return self._resolve_call(expr, depth)
        return None

    def _all(self, values, depth):
        out = []
        for value in values:
            found = self.resolve(value, depth + 1)
            if found is None:
                return None
            out.extend(found)
        return out

    def _resolve_call(self, call: ast.Call, depth: int):
        script, func = self.script, call.func
        q = script.qualname(func) or ""
        if isinstance(func, ast.Name) and func.id == "dict" and "dict" not in script.aliases:
            if len(call.args) > 1 or any(isinstance(a, ast.Starred) for a in call.args):
                return None
            base = {ast.Constant(kw.arg): kw.value for kw in call.keywords if kw.arg}
            merged = [self.resolve(a, depth + 1) for a in call.args]
            merged += [self.resolve(kw.value, depth + 1) for kw in call.keywords if kw.arg is None]
            return _combine(base, merged)
        if q in ("dataclasses.asdict", "copy.copy", "copy.deepcopy") and len(call.args) == 1 and not call.keywords:
            return self.resolve(call.args[0], depth + 1)
        if isinstance(func, ast.Attribute) and func.attr == "copy" and not call.args and not call.keywords:
            return self.resolve(func.value, depth + 1)
        fields = self._dataclass_fields(func)
        if fields is None or len(call.args) > len(fields) or any(isinstance(a, ast.Starred) for a in call.args):
            return None
        if any(kw.arg is None or kw.arg not in fields for kw in call.keywords):
            return None
        entries = {ast.Constant(f): ast.Constant(None) for f in fields}  # a field left at its default
        by_name = {**dict(zip(fields, call.args)), **{kw.arg: kw.value for kw in call.keywords}}
        for key in list(entries):
            if key.value in by_name:
                entries[key] = by_name[key.value]
        return [entries]

    def _dataclass_fields(self, func: ast.AST) -> list[str] | None:
        """The field names of a dataclass defined in this file that ``func`` names, in order."""
        if not isinstance(func, ast.Name) or func.id in self.script.aliases:
            return None
        cls = self.script.classes.get(func.id)
        if cls is None or not any(self._is_dataclass_decorator(d) for d in cls.decorator_list):
            return None
        if cls.bases and not all(isinstance(b, ast.Name) and b.id == "object" for b in cls.bases):
            return None  # inherited fields are not read
        return [
            item.target.id
            for item in cls.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            and "ClassVar" not in ast.unparse(item.annotation)
        ]

    def _is_dataclass_decorator(self, node: ast.AST) -> bool:
        target = node.func if isinstance(node, ast.Call) else node
        return self.script.qualname(target) == "dataclasses.dataclass"

    # --- the rule --------------------------------------------------------------------------

    def hits(self) -> list[Hit]:
        script = self.script
        live = [k for k in script.scaler_keys if script.scaler_enabled(k) is not False]
        if not live or any(script.is_scaler(k) for k, _ in method_calls(script, "state_dict")):
            return []
        mutated_attrs = {k for k, _ in method_calls(script, "") if "." in k} | {
            key_of(t.value)
            for node in script.nodes
            if isinstance(node, (ast.Assign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Subscript)
        }
        uses: dict[str, list[ast.AST]] = {}  # scaler -> where it is named: its methods, passed, built
        for node in script.nodes:
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                k = key_of(node)
                if k in live:
                    uses.setdefault(k, []).append(node)
        for k, sites in script.scaler_sites.items():
            uses.setdefault(k, []).extend(sites)
        saves = self.saves()
        save_ids = {id(call) for call, _, _ in saves}
        hits, reported = [], set()

        def in_scope(call):
            return [
                k
                for k in live
                if any(script.owner(site) is None for site in script.scaler_sites.get(k, []))  # a script's global
                or any(script.same_scope(call, use, k) for use in uses.get(k, []))
            ]

        for call in script.calls:  # a project function that writes its own checkpoint dict, a checkpointer
            holders = in_scope(call) if id(call) not in save_ids else []
            if not holders or any(mentions_scaler(script, a) for a in (*call.args, *(kw.value for kw in call.keywords))):
                continue
            writer = self._writer(call)
            if writer is not None:
                hits.append(Hit("MP111", call, f"checkpoint written by {writer}() has model and optimizer state but "
                                               f"not {sorted(holders)[0]}.state_dict(): pass the scaler's state too"))
            elif checkpointer_without_scaler(script, call):
                hits.append(Hit("MP111", call, f"checkpointer saves the model and the optimizer but not "
                                               f"{sorted(holders)[0]}: add it to the objects it saves"))
        for call, saved, helper in saves:
            holders = in_scope(call)
            if not holders:
                continue
            if not isinstance(saved, ast.Name) and key_of(saved) in mutated_attrs:
                continue
            dicts = self.resolve(saved)
            if not dicts or not all(_lacks_scaler_state(script, d) for d in dicts):
                continue
            if isinstance(saved, ast.Name):
                reaching = self.bindings(call, saved.id).values(saved.id, saved) or []
                if self._changed(saved.id, self.scope(call), save_ids, {id(v) for v in reaching}):
                    continue
            seen = frozenset(id(v) for d in dicts for v in d.values())
            if seen in reported:
                continue  # the same dict saved again (last.pt, best.pt): reported at its first save
            reported.add(seen)
            scaler = sorted(holders)[0]
            via = f" (saved by {helper}())" if helper else ""
            hits.append(Hit("MP111", call, f"checkpoint saves model and optimizer state but not {scaler}.state_dict(){via}"))
        return hits


def _combine(base: dict, merged: list) -> list[dict] | None:
    """``base`` updated by each of the dicts in ``merged`` (each a list of alternatives)."""
    results = [dict()]
    for alternatives in merged:
        if alternatives is None:
            return None
        results = [{**r, **a} for r in results for a in alternatives][:_MAX_COMBINATIONS]
    return [{**r, **base} for r in results]


def _lacks_scaler_state(script: Script, entries: dict) -> bool:
    """Entries with the model's and the optimizer's state and nothing named like a scaler."""
    names = {k: str(k.value).lower() for k in entries if isinstance(k, ast.Constant)}
    if any("scal" in name for name in names.values()):
        return False
    optimizer = [k for k, v in entries.items() if _is_state_dict(v) and script.is_optimizer(key_of(v.func.value))]
    model = [k for k, v in entries.items() if k not in optimizer and (_is_state_dict(v) or "model" in names.get(k, ""))]
    return bool(optimizer and model)


def _is_state_dict(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "state_dict"
        and key_of(node.func.value) is not None
    )


def checkpoint_hits(script: Script) -> list[Hit]:  # MP111
    return Checkpoints(script).hits()
