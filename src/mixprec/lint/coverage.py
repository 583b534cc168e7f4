"""MP115: an autocast region around the loss alone, with the model's forward outside it.

autocast runs matmuls and convolutions in 16 bits only inside its region; a loss computed from
a forward that ran outside it gets fp32 inputs, and the loss functions themselves are never run
in 16 bits. Reported only when it is certain from the text:

* an enabled autocast ``with`` that is not inside another autocast region (nor a function
  decorated with one), whose body holds simple statements only;
* every call in it is a library loss (``F.cross_entropy``, ``F.mse_loss``..., or an instance of
  ``nn.CrossEntropyLoss``, ``nn.MSELoss``... constructed once in the file) or a tensor method that
  reduces or reshapes (``.mean()``, ``.float()``, ``.view()``...);
* an input of such a loss is bound, along the code path, to the result of a call of a module
  (``out = model(x)``, ``out = self.net(x)``: a name not imported, not defined in this file) in
  the same function, outside every autocast region and with gradients on.
"""

from __future__ import annotations

import ast
import builtins

from mixprec.lint.bindings import ScopeBindings, _walk_scope
from mixprec.lint.dtypes import autocast as autocast_of
from mixprec.lint.names import Script, _line_table, key_of
from mixprec.lint.report import Hit

_F_LOSSES = frozenset(
    {
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
        "binary_cross_entropy_with_logits", "cosine_embedding_loss", "margin_ranking_loss",
        "hinge_embedding_loss", "soft_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
        "poisson_nll_loss", "gaussian_nll_loss", "triplet_margin_loss", "ctc_loss",
    }
)
_NN_LOSSES = frozenset(
    {
        "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "KLDivLoss",
        "BCEWithLogitsLoss", "CosineEmbeddingLoss", "MarginRankingLoss", "HingeEmbeddingLoss",
        "SoftMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss", "PoissonNLLLoss",
        "GaussianNLLLoss", "TripletMarginLoss", "CTCLoss",
    }
)
_BENIGN_METHODS = frozenset(
    {"mean", "sum", "float", "item", "view", "reshape", "flatten", "squeeze", "unsqueeze", "long",
     "detach", "contiguous", "size", "permute", "transpose"}
)
_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Pass)


class _Coverage:
    def __init__(self, script: Script):
        self.script = script
        ranges = []  # (first, last line) of every autocast with-body and decorated function
        for node in script.nodes:
            if isinstance(node, (ast.With, ast.AsyncWith)) and any(autocast_of(script, i.context_expr) for i in node.items):
                ranges.append((node.lineno, node.end_lineno))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(autocast_of(script, d) for d in node.decorator_list):
                    ranges.append((node.lineno, node.end_lineno))
        # line -> how many regions hold it, and the innermost one: covered() in constant time
        size = max((r[1] for r in ranges), default=0) + 2
        self.depth = [0] * size
        for first, last in ranges:
            for line in range(first, last + 1):
                self.depth[line] += 1
        self.inner = _line_table(((a, b, (a, b)) for a, b in ranges), size)

    def covered(self, node: ast.AST, outer: ast.AST | None = None) -> bool:
        """Whether ``node`` lies in an autocast region (other than ``outer`` itself)."""
        line = node.lineno
        if line >= len(self.depth) or self.depth[line] == 0:
            return False
        if outer is None or self.depth[line] > 1:
            return True
        return self.inner[line] != (outer.lineno, outer.end_lineno)

    def loss_name(self, call: ast.Call) -> str | None:
        script, func = self.script, call.func
        q = script.qualname(func) or ""
        if q.startswith("torch.nn.functional.") and q.rsplit(".", 1)[1] in _F_LOSSES:
            return ast.unparse(func)
        k = key_of(func)
        value = script.single_value(func) if k else None
        if isinstance(value, ast.Call):
            vq = script.qualname(value.func) or ""
            if vq.startswith("torch.nn.") and vq.rsplit(".", 1)[1] in _NN_LOSSES:
                return k
        return None

    def benign(self, call: ast.Call) -> bool:
        func = self.script.qualname(call.func)
        return func is None and isinstance(call.func, ast.Attribute) and call.func.attr in _BENIGN_METHODS

    def forward(self, value: ast.AST) -> bool:
        """``model(x)`` / ``self.net(x)``: a call of a module this file neither imports nor defines."""
        if not isinstance(value, ast.Call):
            return False
        func, script = value.func, self.script
        if isinstance(func, ast.Name):
            name = func.id
            return not (
                name in script.aliases or name in script.functions or name in script.classes or hasattr(builtins, name)
            )
        k = key_of(func)
        return (
            k is not None and k.count(".") == 1 and k.startswith("self.")
            and func.attr not in script.methods and func.attr not in script.functions
        )

    def check(self, stmt: ast.With, bindings: ScopeBindings) -> Hit | None:
        script = self.script
        regions = [autocast_of(script, i.context_expr) for i in stmt.items]
        if not any(r is not None and r.enabled is not False and r.dtype not in ("fp32", "fp64") for r in regions):
            return None
        if self.covered(stmt, stmt) or not all(isinstance(s, _SIMPLE) for s in stmt.body):
            return None
        losses = []
        for s in stmt.body:
            for node in _walk_scope(s):
                if isinstance(node, ast.Lambda):
                    return None
                if not isinstance(node, ast.Call):
                    continue
                name = self.loss_name(node)
                if name is not None:
                    losses.append((name, node))
                elif not self.benign(node):
                    return None
        for name, call in losses:
            for arg in call.args[:2]:
                if not isinstance(arg, ast.Name):
                    continue
                values = bindings.values(arg.id, arg)
                if not values or len(values) != 1 or not self.forward(values[0]):
                    continue
                origin = bindings.of(arg.id).origin.get(id(values[0]))
                if origin is None or self.covered(origin) or script.without_grad(origin):
                    continue
                return Hit(
                    "MP115",
                    stmt.items[0].context_expr,
                    f"autocast covers only the loss: {name}() is never run in 16 bits, and the forward "
                    f"that produced {arg.id} (line {origin.lineno}: {ast.unparse(values[0].func)}(...)) runs "
                    f"outside autocast, in fp32",
                )
        return None


def coverage_hits(script: Script) -> list[Hit]:  # MP115
    if not script.uses_autocast:
        return []
    coverage = _Coverage(script)
    hits = []
    scopes = [script.tree] + [f for defs in (*script.functions.values(), *script.methods.values()) for f in defs]
    for scope in scopes:
        withs = [n for n in _walk_scope(scope) if isinstance(n, ast.With)]
        if not withs:
            continue
        regions = [w for w in withs if any(autocast_of(script, i.context_expr) for i in w.items)]
        if not regions:
            continue
        bindings = ScopeBindings(scope)
        for stmt in regions:
            hit = coverage.check(stmt, bindings)
            if hit is not None:
                hits.append(hit)
    return hits
