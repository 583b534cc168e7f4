"""MP201: the deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` API, and its exact rewrite.

What the rewrite does (it only rewrites what it can rewrite exactly; anything else is reported
without a fix):

    torch.cuda.amp.autocast(True, torch.float16)  -> torch.autocast("cuda", enabled=True, dtype=torch.float16)
    torch.cuda.amp.GradScaler(init_scale=1024)   -> torch.amp.GradScaler("cuda", init_scale=1024)
    @torch.cuda.amp.custom_fwd(cast_inputs=x)     -> @torch.amp.custom_fwd(cast_inputs=x, device_type="cuda")
    from torch.cuda.amp import autocast           -> from torch.amp import autocast   (and each
                                                     call autocast(...) -> autocast("cuda", ...))

The old autocast takes ``enabled`` first and the new one ``device_type`` then ``dtype``, so
positional arguments are turned into keywords. An attribute spelling needs a module-level name
for ``torch`` to build the new one. A from-import is rewritten only when every use of each name
it imports is a call (or a bare decorator) that can be rewritten, and not when the file imports
the same name from elsewhere too (a try/except fallback for old torch is left alone).

A fallback for old torch is not reported at all, and so never rewritten (the rewrite would break
the very torch it exists for): a deprecated use in one arm of a torch-version test whose other arm
uses the current twin (``torch.amp.GradScaler("cuda") if TORCH_2_4 else torch.cuda.amp.GradScaler()``,
the same as an if/else statement, ``hasattr(torch.amp, "GradScaler")`` as the test), or in an
``except (AttributeError, TypeError)`` (or ImportError, NameError, Exception) handler of a ``try``
that calls the twin.
"""

from __future__ import annotations

import ast
import re

from mixprec.lint.fixes import Source
from mixprec.lint.names import TORCH_STAR_EXPORTS, Script, canonical
from mixprec.lint.report import Edit, Hit

# deprecated name -> (device, name under torch.amp / torch)
DEPRECATED: dict[str, tuple[str, str]] = {
    f"torch.{device}.amp.{name}": (device, name)
    for device, names in (("cuda", ("autocast", "GradScaler", "custom_fwd", "custom_bwd")), ("cpu", ("autocast", "GradScaler")))
    for name in names
}
_OLD_AUTOCAST_ARGS = ("enabled", "dtype", "cache_enabled")
# deprecated name -> the current spellings of the same object (canonical qualnames)
_TWINS = {
    "autocast": frozenset({"torch.autocast"}),
    "GradScaler": frozenset({"torch.amp.GradScaler", "torch.GradScaler"}),
    "custom_fwd": frozenset({"torch.amp.custom_fwd"}),
    "custom_bwd": frozenset({"torch.amp.custom_bwd"}),
}
# what an old torch raises where the current API is missing or takes other arguments
_FALLBACK_ERRORS = frozenset(
    {"AttributeError", "TypeError", "ImportError", "ModuleNotFoundError", "NameError", "Exception", "BaseException"}
)
# a name that reads as a torch version flag or check: TORCH_2_4, torch_version, is_torch_greater_or_equal
_VERSION_WORDS = re.compile(r"\d|version|greater|less|newer|older|least|_[gl][te](_|$)", re.I)
_MODULE = re.compile(r"from\s+(torch\s*\.\s*c(?:uda|pu)\s*\.\s*amp(?:\s*\.\s*\w+)*)\s+import\b")


def _new_spelling(torch_name: str, name: str) -> str:
    return f"{torch_name}.autocast" if name == "autocast" else f"{torch_name}.amp.{name}"


def _replacement_hint(qualname: str) -> str:
    device, name = DEPRECATED[qualname]
    if name.startswith("custom_"):
        return f'torch.amp.{name}(device_type="{device}")'
    new = "torch.autocast" if name == "autocast" else f"torch.amp.{name}"
    return f'{new}("{device}", ...)'


class _Rewriter:
    def __init__(self, script: Script, source: Source):
        self.script = script
        self.source = source
        self._parents: dict[int, ast.AST] | None = None

    @property
    def parents(self) -> dict[int, ast.AST]:
        """child id -> parent node, built on the first deprecated use (most files have none)."""
        if self._parents is None:
            self._parents = {id(c): node for node in self.script.nodes for c in ast.iter_child_nodes(node)}
        return self._parents

    def use(self, ref: ast.expr, qualname: str, new_func: str | None) -> list[Edit] | None:
        """Edits for one use ``ref`` of a deprecated name; ``new_func`` replaces ``ref``'s text
        (None: keep it, the import changes instead). None when no exact rewrite exists."""
        device, name = DEPRECATED[qualname]
        parent = self.parents.get(id(ref))
        start, end = self.source.span(ref)
        head = [Edit(start, end, new_func)] if new_func is not None else []
        if isinstance(parent, ast.Call) and parent.func is ref:
            args = self._arguments(parent, device, name)
            return None if args is None else head + args
        is_decorator = any(ref is d for d in getattr(parent, "decorator_list", ()))
        if is_decorator and name.startswith("custom_"):
            return head + [Edit(end, end, f'(device_type="{device}")')]
        return None

    def _arguments(self, call: ast.Call, device: str, name: str) -> list[Edit] | None:
        if name.startswith("custom_"):
            if any(kw.arg == "device_type" for kw in call.keywords):
                return None
            items = [*call.args, *call.keywords]
            if not items:
                paren = self.source.open_paren(call)
                return None if paren is None else [Edit(paren, paren, f'device_type="{device}"')]
            end = max(self.source.span(item)[1] for item in items)
            return [Edit(end, end, f', device_type="{device}"')]
        paren = self.source.open_paren(call)
        if paren is None or any(isinstance(a, ast.Starred) for a in call.args):
            return None
        first = f'"{device}"' + (", " if call.args or call.keywords else "")
        edits = [Edit(paren, paren, first)]
        if name == "autocast":
            if len(call.args) > len(_OLD_AUTOCAST_ARGS):
                return None
            for arg, keyword in zip(call.args, _OLD_AUTOCAST_ARGS):
                at = self.source.span(arg)[0]
                edits.append(Edit(at, at, f"{keyword}="))
        return edits


def _version_test(script: Script, test: ast.AST, depth: int = 0) -> bool:
    """Whether an ``if`` test reads the torch version or probes torch for an attribute:
    ``torch.__version__``, a ``TORCH_2_4``-like flag, ``is_torch_version(...)``,
    ``hasattr(torch.amp, "GradScaler")``, or a name bound once to one of those."""
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr == "__version__":
            return True
        if isinstance(node, (ast.Name, ast.Attribute)):
            word = node.id if isinstance(node, ast.Name) else node.attr
            if "torch" in word.lower() and _VERSION_WORDS.search(word.lower().replace("torch", "", 1)):
                return True
            value = script.single_value(node) if isinstance(node, ast.Name) and depth < 2 else None
            if value is not None and _version_test(script, value, depth + 1):
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if node.args and (script.qualname(node.args[0]) or "").startswith("torch"):
                return True
    return False


def _has_twin(script: Script, body: list[ast.AST], name: str) -> bool:
    """Whether ``body`` uses the current API's spelling of the deprecated ``name``."""
    twins = _TWINS[name]
    for part in body:
        for node in ast.walk(part):
            if isinstance(node, (ast.Name, ast.Attribute)) and script.qualname(node) in twins:
                return True
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if any(canonical(f"{node.module}.{a.name}") in twins for a in node.names):
                    return True
    return False


def _catches_missing_api(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _FALLBACK_ERRORS for t in types)


def in_fallback_arm(script: Script, parents: dict[int, ast.AST], node: ast.AST, name: str) -> bool:
    """Whether ``node`` (a use of the deprecated ``name``) is the old-torch arm of a fallback."""
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, (ast.IfExp, ast.If)) and child is not parent.test:
            if isinstance(parent, ast.IfExp):
                other = [parent.orelse if child is parent.body else parent.body]
            else:
                other = parent.orelse if any(child is s for s in parent.body) else parent.body
            if _version_test(script, parent.test) and _has_twin(script, other, name):
                return True
        elif isinstance(parent, ast.ExceptHandler) and _catches_missing_api(parent):
            attempt = parents.get(id(parent))
            if attempt is not None and _has_twin(script, attempt.body, name):
                return True
        child, parent = parent, parents.get(id(parent))
    return False


def deprecated_hits(script: Script, source: Source) -> list[Hit]:
    rewriter = _Rewriter(script, source)
    torch_name = script.torch_name()
    hits: list[Hit] = []
    for node in script.nodes:
        if isinstance(node, ast.Attribute):
            qualname = script.qualname(node)
            if qualname in DEPRECATED and in_fallback_arm(script, rewriter.parents, node, DEPRECATED[qualname][1]):
                continue
            if qualname in DEPRECATED:
                new_func = _new_spelling(torch_name, DEPRECATED[qualname][1]) if torch_name else None
                edits = rewriter.use(node, qualname, new_func) if new_func else None
                message = f"{qualname} is deprecated; use {_replacement_hint(qualname)}"
                hits.append(Hit("MP201", node, message, tuple(edits) if edits else None))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            hit = _import_hit(script, source, rewriter, node)
            if hit is not None:
                hits.append(hit)
    return hits


def _star_hit(script: Script, rewriter: _Rewriter, node: ast.ImportFrom) -> Hit | None:
    """``from torch.cuda.amp import *``: reported at the import, naming the deprecated names the
    file uses (all of them when it uses none); not rewritten."""
    module = canonical(node.module)
    names = [n for n in TORCH_STAR_EXPORTS[module] if n not in script.deprecated_shims]
    if not names or in_fallback_arm(script, rewriter.parents, node, names[0]):
        return None
    used = {r.id for r in script.nodes if isinstance(r, ast.Name) and isinstance(r.ctx, ast.Load)}
    names = [n for n in names if n in used] or names
    old = [f"{module}.{n}" for n in names]
    hint = "; ".join(_replacement_hint(q) for q in old)
    message = f"from {module} import * brings in the deprecated {', '.join(old)}; use {hint}"
    return Hit("MP201", node, message)


def _import_hit(script: Script, source: Source, rewriter: _Rewriter, node: ast.ImportFrom) -> Hit | None:
    if any(a.name == "*" for a in node.names) and canonical(node.module) in TORCH_STAR_EXPORTS:
        return _star_hit(script, rewriter, node)
    found = [(a, canonical(f"{node.module}.{a.name}")) for a in node.names]
    old = [(a, q) for a, q in found if q in DEPRECATED and (a.asname or a.name) not in script.deprecated_shims]
    old = [(a, q) for a, q in old if not in_fallback_arm(script, rewriter.parents, node, DEPRECATED[q][1])]
    fallback_uses = set()  # names some of whose uses are old-torch fallbacks: the import serves them
    for alias, qualname in old:
        local = alias.asname or alias.name
        uses = [r for r in script.nodes if isinstance(r, ast.Name) and r.id == local]
        in_fallback = [r for r in uses if in_fallback_arm(script, rewriter.parents, r, DEPRECATED[qualname][1])]
        if in_fallback and len(in_fallback) == len(uses):
            fallback_uses.add(local)  # the import exists for the fallback only: not reported
        elif in_fallback:
            fallback_uses.add("")  # mixed: reported, but a rewrite would break the fallback
    old = [(a, q) for a, q in old if (a.asname or a.name) not in fallback_uses]
    if not old:
        return None
    names = ", ".join(q for _, q in old)
    hint = "; ".join(_replacement_hint(q) for _, q in old)
    message = f"{names} {'is' if len(old) == 1 else 'are'} deprecated; use {hint}"
    edits: list[Edit] | None = None
    if len(old) == len(found) and "" not in fallback_uses:
        edits = _module_edit(source, node)
        for alias, qualname in old:
            local = alias.asname or alias.name
            for ref in script.nodes:
                if edits is None:
                    break
                if isinstance(ref, ast.Name) and ref.id == local:
                    more = rewriter.use(ref, qualname, None)
                    edits = None if more is None else edits + more
    return Hit("MP201", node, message, tuple(edits) if edits else None)


def _module_edit(source: Source, node: ast.ImportFrom) -> list[Edit] | None:
    start, end = source.span(node)
    match = _MODULE.match(source.text, start, end)
    if match is None:
        return None
    return [Edit(match.start(1), match.end(1), "torch.amp")]
