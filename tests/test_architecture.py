"""The walls between mixprec's rooms, read from the imports (``ast``; nothing is imported).

docs/architecture.md describes the rooms; this file is the part of it a machine can check:

- the core imports no capability at module level and no tool, report, CLI, task or integration
  at all (one named exception: ``nan_guard=`` imports the guard when a user asks for it);
- capabilities (fp8, distributed) import the core and each other, never a tool;
- the shared rooms (instruments, tasks, report) import the core at most; ``report`` only itself
  and ``formats`` (it is handed data, it does not ask tools for it);
- a tool imports no other tool (nor the CLI); ``lint`` imports nothing of mixprec outside itself
  (and no torch);
- ``jax`` and ``integrations`` are imported by nothing else (``mixprec compare --backend jax``
  imports ``mixprec.jax`` inside the command's function);
- no import circles between modules, lazy and TYPE_CHECKING imports included;
- no module in src/ over 500 lines.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "mixprec"

CORE = {"formats", "policy", "recipes", "scaling", "islands", "masters", "step_io", "training", "seam", "_lazy", "_env",
        "autotune", "attention", "_files"}
CAPABILITIES = {"fp8", "distributed"}
SHARED = {"instruments", "tasks", "report", "arguments"}
TOOLS = {"comparison", "diagnostics", "bench", "memory", "lint", "inference"}
FACE = {"cli", "__main__", ""}  # "" is mixprec/__init__.py: the public table, lazy
OUTSIDE = {"jax", "integrations"}
ROOMS = CORE | CAPABILITIES | SHARED | TOOLS | FACE | OUTSIDE

# (importer, imported) pairs allowed across a wall, each for a stated reason; all are lazy.
EXCEPTIONS = {
    ("mixprec.training", "mixprec.diagnostics.guard"),  # MixedPrecision(nan_guard=...) attaches the guard
    ("mixprec.step_io", "mixprec.diagnostics.guard"),  # ... and checks the mode it names
    ("mixprec.comparison.cli", "mixprec.jax"),  # mixprec compare --backend jax
    ("mixprec.comparison.cli", "mixprec.jax.comparison_cli"),
}
MAX_LINES = 500


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a mixprec module (a package's __init__ is the package's name)
    lazy: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The mixprec module a dotted name refers to (the longest prefix that is a module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str) -> list[Import]:
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, typing_only)
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, typing_only)
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in child.names]
            for t in targets:
                resolved = _resolve(t) if t.startswith("mixprec") else None
                if resolved and resolved != name:
                    found.append(Import(name, resolved, lazy, typing_only, child.lineno))
            visit(child, lazy, typing_only)

    visit(tree, False, False)
    return found


ALL_IMPORTS = [imp for name in MODULES for imp in imports_of(name)]


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(allowed, *, lazy_allowed=frozenset()) -> list[str]:
    out = []
    for imp in ALL_IMPORTS:
        src, dst = room(imp.importer), room(imp.target)
        if src == dst or (imp.importer, imp.target) in EXCEPTIONS and imp.lazy:
            continue
        ok = allowed(src, dst) or (imp.lazy and (src, dst) in lazy_allowed)
        if not ok:
            out.append(f"{imp.importer} -> {imp.target} (line {imp.line}{', lazy' if imp.lazy else ''})")
    return out


def test_every_module_is_in_a_known_room():
    assert {room(m) for m in MODULES} <= ROOMS, {room(m) for m in MODULES} - ROOMS


def test_the_core_imports_no_tool_report_cli_task_or_integration():
    lazy_ok = {(c, cap) for c in CORE for cap in CAPABILITIES}  # prepare/step call fp8/distributed when asked
    bad = _violations(lambda s, d: s not in CORE or d in CORE, lazy_allowed=lazy_ok)
    assert bad == []


def test_capabilities_import_only_the_core_and_each_other():
    bad = _violations(lambda s, d: s not in CAPABILITIES or d in CORE | CAPABILITIES | {"instruments"})
    assert bad == []


def test_shared_rooms_import_the_core_at_most_and_report_only_formats():
    bad = _violations(lambda s, d: s not in SHARED or (d in CORE and s != "report") or (s == "report" and d == "formats"))
    assert bad == []


def test_a_tool_imports_no_other_tool_and_lint_nothing_outside_itself():
    # (``import mixprec`` for ``__version__`` is the package's own face, not another tool)
    bad = _violations(lambda s, d: s not in TOOLS or d == "" or (s != "lint" and d not in TOOLS | FACE | OUTSIDE))
    assert bad == []


def test_jax_and_integrations_are_imported_by_nothing_else():
    bad = _violations(lambda s, d: d not in OUTSIDE)
    assert bad == []


def test_lint_never_imports_torch():
    for name, path in MODULES.items():
        if room(name) != "lint":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m == "torch" or m.startswith("torch.") for m in mods), (name, node.lineno)


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in ALL_IMPORTS:
        graph[imp.importer].add(imp.target)
    # a package's __init__ re-exporting its submodules, and those submodules naming each other
    # through the package, is one room speaking to itself, not a circle between rooms: edges from
    # a submodule to its own package are left out
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    assert _cycles() == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_500_lines(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it along a seam"


def test_the_wall_test_sees_imports_at_every_depth():
    # the reader itself: a lazy import inside a method, a TYPE_CHECKING import, a relative import
    names = {(i.target, i.lazy, i.typing_only) for i in imports_of("mixprec.training")}
    assert ("mixprec.diagnostics.guard", True, False) in names
    assert ("mixprec.scaling", False, False) in names or any(t.startswith("mixprec.scaling") for t, _, _ in names)
