"""The project a file belongs to: its other modules, parsed once, and what an imported name is.

A training step is spread over files: ``main`` in train.py builds the scaler and calls
``train_one_epoch(model, loader, optimizer, scaler)`` from engine.py, which calls
``utils.save_checkpoint(state, path)``. ``Project.definition`` answers "which function or class
of the project is this call's callee?" for a name the file defines, imports
(``from engine import train_one_epoch``, ``import util.misc as misc``, ``from .utils import
save``) or re-exports through a package ``__init__`` (``from .checkpoint import *``), so that the
rules can follow the call into it. Modules are found as star imports are (see ``project``): next
to the importing file and in the directories above it, up to the project's root; nothing is
imported or run. A module that cannot be found or parsed is "not the project's" and the call
stays opaque.
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass
from pathlib import Path

from mixprec.lint.names import Script, key_of
from mixprec.lint.project import _module_file, free_names, has_star_import, star_aliases

_MAX_HOPS = 4  # re-exports followed through package __init__ files
_EXTERNAL = ("torch", "mixprec", "numpy", "math", "os", "sys")  # never a project's module: no search


@dataclass(frozen=True)
class Definition:
    """A function or class of the project, and the file (Script) it is written in."""

    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    script: Script

    @property
    def is_class(self) -> bool:
        return isinstance(self.node, ast.ClassDef)

    def method(self, name: str):
        """The class's own method ``name`` (no base classes), or None."""
        if not self.is_class:
            return None
        return self.script.class_methods.get(self.node.name, {}).get(name)


def parse(tree: ast.Module, path: str | Path | None) -> Script:
    """The Script of a parsed file, with the names its star imports of project modules bring."""
    script = Script(tree)
    if path is not None and has_star_import(tree) and Path(path).is_file():
        free = free_names(script.nodes)
        stars = star_aliases(tree, path, free) if free else None
        if stars:  # names from the project's own star-imported modules: read the file again with them
            script = Script(tree, stars)
    return script


class Project:
    """The files of one lint run and the project modules they import, each parsed once."""

    def __init__(self):
        self._scripts: dict[Path, Script | None] = {}
        self._texts: dict[Path, str] = {}
        self._files: dict[tuple, Path | None] = {}  # (module, level, importing directory) -> file
        self._found: dict[tuple[int, str], Definition | None] = {}  # (script, dotted name) -> definition
        self.memo: dict[tuple, object] = {}  # what the rules learned about a project function, once

    def for_text(self, text: str, tree: ast.Module, path: str | Path | None) -> Script:
        """The Script of a file being linted: the one already parsed for an import of it when
        its text is the same, else a new one, which imports of the file then resolve to."""
        resolved = Path(path).resolve() if path is not None and Path(path).is_file() else None
        if resolved is not None and self._texts.get(resolved) == text and self._scripts.get(resolved) is not None:
            return self._scripts[resolved]
        script = parse(tree, path)
        script.project = self
        if resolved is not None:
            script.path = resolved
            self._scripts[resolved], self._texts[resolved] = script, text
        return script

    def script(self, path: Path) -> Script | None:
        """The Script of a project module (None when it cannot be read or parsed)."""
        path = path.resolve()
        if path not in self._scripts:
            self._scripts[path] = None  # a module importing itself in a cycle stays opaque meanwhile
            try:
                raw = path.read_bytes()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SyntaxWarning)
                    tree = ast.parse(raw)
            except (OSError, SyntaxError, ValueError):
                return None
            found = parse(tree, path)
            found.path, found.project = path, self
            self._scripts[path] = found
            self._texts[path] = raw.decode("utf-8", errors="replace")
        return self._scripts[path]

    # --- names -----------------------------------------------------------------------------

    def module_file(self, module: str | None, level: int, importer: Path) -> Path | None:
        """The file of ``module`` imported from ``importer`` (cached: the search stats files)."""
        key = (module, level, importer.parent)
        if key not in self._files:
            self._files[key] = _module_file(module, level, importer)
        return self._files[key]

    def definition(self, script: Script, node: ast.AST, hops: int = 0) -> Definition | None:
        """The project function or class that ``node`` (a Name or a dotted Attribute, as in a
        call's ``func``) names in ``script``; None when it is not one."""
        k = key_of(node)
        if k is None or hops > _MAX_HOPS:
            return None
        memo = (id(script), k)
        if memo not in self._found:
            self._found[memo] = self._definition(script, k, hops)
        return self._found[memo]

    def _definition(self, script: Script, k: str, hops: int) -> Definition | None:
        root, _, rest = k.partition(".")
        if not rest:
            return self._top(script, root, hops)
        if root in script.relative:  # from . import utils; utils.save(...)
            module = self._relative_module(script, *script.relative[root])
            return self._in_module(module, rest, hops + 1) if module is not None else None
        if root in script.aliases and root not in script.assigns:
            target = script.aliases[root]
            if target.split(".")[0] in _EXTERNAL:
                return None
            return self._qualified(script, f"{target}.{rest}", hops + 1)
        return None

    def _top(self, script: Script, name: str, hops: int) -> Definition | None:
        """``name`` at the top of ``script``: a def, a class, or an imported name."""
        if hops > _MAX_HOPS:
            return None
        for node in script.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return Definition(node, script)
        if name in script.relative:
            level, module, attr = script.relative[name]
            found = self._relative_module(script, level, module, None)
            if found is not None:
                hit = self._in_module(found, attr, hops + 1)
                if hit is not None:
                    return hit
            return None
        target = script.aliases.get(name)
        if target is None or target.split(".")[0] in _EXTERNAL or "." not in target:
            return None
        return self._qualified(script, target, hops + 1)

    def _qualified(self, script: Script, qualname: str, hops: int) -> Definition | None:
        """``pkg.mod.func`` (or ``pkg.mod.Class.method`` is not followed) from ``script``."""
        if script.path is None:
            return None
        parts = qualname.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            path = self.module_file(".".join(parts[:cut]), 0, script.path)
            if path is not None:
                module = self.script(path)
                return self._in_module(module, ".".join(parts[cut:]), hops) if module is not None else None
        return None

    def _relative_module(self, script: Script, level: int, module: str | None, attr: str | None) -> Script | None:
        if script.path is None:
            return None
        name = ".".join(p for p in (module, attr) if p)
        path = self.module_file(name or None, level, script.path)
        if path is None and attr is not None:
            path = self.module_file(module, level, script.path)  # ``from . import func`` of a package
        return self.script(path) if path is not None else None

    def _in_module(self, module: Script, name: str, hops: int) -> Definition | None:
        if hops > _MAX_HOPS:
            return None
        first, _, rest = name.partition(".")
        if rest:  # ``pkg.sub.func`` where ``sub`` is a module of the package ``pkg``
            sub = self.module_file(first, 1, module.path) if module.path is not None else None
            inner = self.script(sub) if sub is not None else None
            return self._in_module(inner, rest, hops + 1) if inner is not None else None
        found = self._top(module, first, hops)
        if found is not None:
            return found
        for stmt in module.tree.body:  # ``from .checkpoint import *`` in a package __init__
            if isinstance(stmt, ast.ImportFrom) and stmt.level and any(a.name == "*" for a in stmt.names):
                star = self._relative_module(module, stmt.level, stmt.module, None)
                if star is not None and star is not module:
                    hit = self._in_module(star, first, hops + 1)
                    if hit is not None:
                        return hit
        return None
