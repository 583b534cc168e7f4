"""MP117: ``autocast(enabled=False)`` around fp32 work on tensors that are still 16-bit.

Disabling autocast inside an autocast region stops the casting; it does not convert what the
region already computed. Reported when, in one function:

* a ``with`` that disables autocast (``enabled=False``, literally) sits inside a ``with`` that
  enables a 16-bit autocast (or may: ``enabled=amp``);
* inside it, a library loss (``F.l1_loss``, an ``nn.MSELoss()`` of the file...) or a torch op that
  CUDA autocast would run in fp32 (``exp``, ``log``, ``softmax``, ``pow``...) is called on a name
  bound earlier in the function, inside an enabled 16-bit region (this one or an earlier one),
  to the result of a call (a forward, a transform of one, ``.half()``), and not bound again
  outside a region since; and that name is not upcast first (``x.float()``,
  ``x.to(torch.float32)``, ``x.double()``), neither in the call nor in the region before it.

Calls of the project's own functions are not judged (they may upcast inside, as VITS's losses
do), nor names the outer region did not compute.
"""

from __future__ import annotations

import ast

from mixprec.lint.coverage import _Coverage
from mixprec.lint.dtypes import autocast as autocast_of
from mixprec.lint.names import Script
from mixprec.lint.report import Hit

_FP32_OPS = frozenset({"exp", "expm1", "log", "log1p", "log2", "log10", "pow", "softmax", "log_softmax", "logsumexp",
                       "reciprocal", "rsqrt", "softplus", "layer_norm", "group_norm", "norm", "cumsum", "sum", "prod"})
_UPCASTS = frozenset({"float", "double"})


def _region(script: Script, node: ast.With):
    """The autocast a ``with`` enters (None if none)."""
    for item in node.items:
        found = autocast_of(script, item.context_expr)
        if found is not None:
            return found
    return None


def _body_nodes(stmts):
    todo = list(stmts)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)


def _upcast(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in _UPCASTS and not node.args:
            return True
        if node.func.attr in ("to", "type") and any("float32" in ast.unparse(a) or "double" in ast.unparse(a)
                                                      or "float64" in ast.unparse(a) for a in node.args):
            return True
    return False


class _Disabled:
    def __init__(self, script: Script):
        self.script = script
        self.coverage = _Coverage(script)

    def op(self, call: ast.Call) -> str | None:
        """The name of a library loss or a torch op autocast would run in fp32, else None."""
        script, func = self.script, call.func
        loss = self.coverage.loss_name(call)
        if loss is not None:
            return loss
        q = script.qualname(func) or ""
        if q.startswith("torch.") and q.rsplit(".", 1)[-1] in _FP32_OPS:
            return ast.unparse(func)
        if isinstance(func, ast.Attribute) and script.qualname(func) is None and func.attr in _FP32_OPS:
            if isinstance(func.value, ast.Name):  # x.exp(), x.softmax(-1) on a local tensor
                return ast.unparse(func)
        return None

    def check(self, inner: ast.With, regions: list[ast.With]) -> list[Hit]:
        """``inner``: a region that disables autocast inside an enabled one; ``regions``: the
        function's enabled 16-bit regions."""
        # names bound, before ``inner``, inside an enabled region to the result of a call (and
        # not bound again outside one since): the values that are 16-bit when ``inner`` starts
        owner = self.script.owner(inner)
        spans = [(w.lineno, w.end_lineno) for w in regions]
        assigns = sorted(
            (n for n in self.script.nodes if isinstance(n, ast.Assign) and n.lineno < inner.lineno
             and self.script.owner(n) is owner),
            key=lambda n: (n.lineno, n.col_offset),
        )
        computed: dict[str, ast.AST] = {}
        for node in assigns:
            inside = any(a <= node.lineno <= b for a, b in spans)
            for name in (n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                if inside and isinstance(node.value, ast.Call) and not _upcast(node.value):
                    computed[name] = node
                else:
                    computed.pop(name, None)
        upcast_here = set()
        hits = []
        for stmt in inner.body:
            for node in _body_nodes([stmt]):
                if isinstance(node, ast.Assign) and _upcast(node.value):
                    upcast_here.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
            for node in _body_nodes([stmt]):
                if not isinstance(node, ast.Call):
                    continue
                name = self.op(node)
                if name is None:
                    continue
                method = isinstance(node.func, ast.Attribute) and self.script.qualname(node.func) is None \
                    and self.coverage.loss_name(node) is None
                operands = [node.func.value] if method else list(node.args[:2])
                operands = [a for a in operands if isinstance(a, ast.Name)]
                low = [a.id for a in operands if a.id in computed and a.id not in upcast_here]
                if low:
                    hits.append(Hit(
                        "MP117", node,
                        f"{name}() runs on {', '.join(low)}, computed under the enclosing autocast (16-bit): "
                        f"autocast(enabled=False) does not upcast them; use {low[0]}.float()",
                    ))
                    return hits
        return hits


def disabled_hits(script: Script) -> list[Hit]:  # MP117
    if not script.uses_autocast:
        return []
    checker = _Disabled(script)
    withs = [n for n in script.nodes if isinstance(n, (ast.With, ast.AsyncWith))]
    regions = {id(w): _region(script, w) for w in withs}
    hits = []
    for inner in withs:
        region = regions[id(inner)]
        if region is None or region.enabled is not False:
            continue
        enabled = [
            w for w in withs
            if regions[id(w)] is not None and regions[id(w)].enabled is not False
            and regions[id(w)].dtype not in ("fp32", "fp64") and script.owner(w) is script.owner(inner)
        ]
        if any(w.lineno < inner.lineno <= w.end_lineno for w in enabled):  # nested in an enabled region
            hits.extend(checker.check(inner, enabled))
    return hits
