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
"""

from __future__ import annotations

import ast
import re

from mixprec.lint.fixes import Source
from mixprec.lint.names import Script, canonical
from mixprec.lint.report import Edit, Hit

# deprecated name -> (device, name under torch.amp / torch)
DEPRECATED: dict[str, tuple[str, str]] = {
    f"torch.{device}.amp.{name}": (device, name)
    for device, names in (("cuda", ("autocast", "GradScaler", "custom_fwd", "custom_bwd")), ("cpu", ("autocast", "GradScaler")))
    for name in names
}
_OLD_AUTOCAST_ARGS = ("enabled", "dtype", "cache_enabled")
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


def deprecated_hits(script: Script, source: Source) -> list[Hit]:
    rewriter = _Rewriter(script, source)
    torch_name = script.torch_name()
    hits: list[Hit] = []
    for node in script.nodes:
        if isinstance(node, ast.Attribute):
            qualname = script.qualname(node)
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


def _import_hit(script: Script, source: Source, rewriter: _Rewriter, node: ast.ImportFrom) -> Hit | None:
    found = [(a, canonical(f"{node.module}.{a.name}")) for a in node.names]
    old = [(a, q) for a, q in found if q in DEPRECATED and (a.asname or a.name) not in script.deprecated_shims]
    if not old:
        return None
    names = ", ".join(q for _, q in old)
    hint = "; ".join(_replacement_hint(q) for _, q in old)
    message = f"{names} {'is' if len(old) == 1 else 'are'} deprecated; use {hint}"
    edits: list[Edit] | None = None
    if len(old) == len(found):
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
