"""Names a file gets from a star import of a module in the same project.

``from utils.general import *`` where ``utils/general.py`` does ``import torch`` binds ``torch``
in the importing file; without reading that module, the rules could not tell that
``torch.cuda.amp.autocast()`` there is torch's. Only the star module's own module-level imports
are taken (and those of the modules it star-imports in turn, two levels), filtered by its
``__all__`` when it spells one out, never a name it assigns or defines itself. The module is
looked for next to the file and in the directories above it, up to the project's root (the
first directory with a pyproject.toml, setup.py, setup.cfg or .git); nothing is imported.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import warnings
from pathlib import Path

from mixprec.lint.names import _bindings, _module_statements

_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
_MAX_UP = 8  # directories above the file searched for an absolute module
_MAX_DEPTH = 2  # star imports followed through star imports
# the names an import statement mentions, on one line or in parentheses over several
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+[\w.]+[ \t]+)?import[ \t]+(\([^)]*\)|[^\n]*)", re.M)
_BUILTINS = frozenset(dir(builtins))


def free_names(nodes: list[ast.AST]) -> set[str]:
    """Names a file reads but never binds (nor imports, nor gets from builtins): the only ones a
    star import can supply."""
    loads, bound = set(), set()
    for node in nodes:
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update(name for name, _ in _bindings(node))
    return loads - bound - _BUILTINS


def has_star_import(tree: ast.Module) -> bool:
    return any(
        isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names) for s in _module_statements(tree.body)
    )


@functools.lru_cache(maxsize=512)
def _imported_words(path: Path, mtime_ns: int) -> frozenset[str]:
    """The words of a module's import statements, read from its text without parsing it
    ("*" when it star-imports in turn)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    words: set[str] = set()
    for match in _IMPORT.finditer(text):
        part = match.group(1)
        words.update(re.findall(r"\w+", part))
        if "*" in part:
            words.add("*")
    return frozenset(words)


def _module_file(module: str | None, level: int, importer: Path) -> Path | None:
    parts = module.split(".") if module else []
    if level:
        base = importer.parent
        for _ in range(level - 1):
            base = base.parent
        bases = [base]
    else:
        bases = []
        for directory in [importer.parent, *importer.parent.parents][:_MAX_UP]:
            bases.append(directory)
            if any((directory / marker).exists() for marker in _ROOT_MARKERS):
                break
    for base in bases:
        target = base.joinpath(*parts)
        for candidate in (target.with_suffix(".py") if parts else None, target / "__init__.py"):
            if candidate is not None and candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=512)
def _module_facts(path: Path, mtime_ns: int):
    """(imports, defined names, ``__all__`` or None, tree) of one module, parsed once per run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return {}, set(), None, None
    found: dict[str, str] = {}
    defined: set[str] = set()
    public: list[str] | None = None
    for stmt in _module_statements(tree.body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for name, target in _bindings(stmt):
                found[name] = target
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                defined |= names
                if "__all__" in names and isinstance(stmt, ast.Assign) and isinstance(stmt.value, (ast.List, ast.Tuple)):
                    items = stmt.value.elts
                    if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items):
                        public = [e.value for e in items]
    has_star = any(isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names) for s in _module_statements(tree.body))
    return found, defined, public, (tree if has_star else None)


def _exported_imports(path: Path, mtime_ns: int, depth: int) -> dict[str, str]:
    """{name: qualified name} for each module-level import ``path`` exports to a star import."""
    own, defined, public, star_tree = _module_facts(path, mtime_ns)
    found: dict[str, str] = {}
    if star_tree is not None and depth < _MAX_DEPTH:
        found.update(star_aliases(star_tree, path, None, depth + 1))
    found.update(own)
    names = [n for n in found if n not in defined]
    names = [n for n in names if n in public] if public is not None else [n for n in names if not n.startswith("_")]
    return {n: found[n] for n in names}


def star_aliases(
    tree: ast.Module, path: str | Path | None, wanted: set[str] | None = None, depth: int = 0
) -> dict[str, str]:
    """Imported names that star imports in ``tree`` (the file at ``path``) bring in; with
    ``wanted``, only those names, and a star module none of whose imports mentions one of
    them is not parsed at all."""
    if path is None:
        return {}
    importer = Path(path)
    out: dict[str, str] = {}
    for stmt in _module_statements(tree.body):
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            if stmt.module and stmt.module.split(".")[0] in ("torch", "mixprec") and not stmt.level:
                continue  # an installed package, not the project's own module
            found = _module_file(stmt.module, stmt.level, importer)
            if found is None or found.resolve() == importer.resolve():
                continue
            try:
                mtime = found.stat().st_mtime_ns
            except OSError:
                continue
            found = found.resolve()
            if wanted is not None and not (_imported_words(found, mtime) & (wanted | {"*"})):
                continue
            out.update(_exported_imports(found, mtime, depth))
    return out if wanted is None else {k: v for k, v in out.items() if k in wanted}
