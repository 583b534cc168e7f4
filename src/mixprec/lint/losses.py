"""Which custom losses in a file are numerically sensitive (rule MP110).

"Sensitive" is kept narrow on purpose, so that a report is worth reading. A loss is sensitive
when all of these hold:

* it is defined in the same file, as a function or method whose name contains ``loss`` (a method
  counts when called as ``self.<name>(...)``) or as a class whose name contains ``Loss`` (its
  ``forward`` is read, and calls of its instances count);
* its body uses ``log``/``log1p``/``log2``/``log10``/``exp``/``expm1``/``logsumexp``/``sqrt``/
  ``rsqrt``/``reciprocal`` (as ``torch.*`` functions or tensor methods), a power whose exponent
  is not a number literal (``(1 - p) ** gamma``, ``p.pow(gamma)``), or a division by a fragile
  value: one with a small epsilon added or a norm/std/sqrt (``inter / (union + 1e-6)``,
  ``x / x.norm()``) -- not a masked mean's ``/ mask.sum()``;
* it does not take care of precision itself: no ``.float()``/``.double()``, no ``.to(...)``/
  ``dtype=`` to fp32 or fp64, no ``autocast(enabled=False)`` inside, no
  ``custom_fwd(cast_inputs=...)``.

Library losses (``F.cross_entropy``, ``nn.MSELoss``) are never sensitive here: autocast already
runs them in fp32.
"""

from __future__ import annotations

import ast

from mixprec.lint.names import Script, key_of

_SENSITIVE = frozenset(
    {"log", "log1p", "log2", "log10", "exp", "expm1", "logsumexp", "sqrt", "rsqrt", "reciprocal"}
)
_FRAGILE_CALLS = frozenset({"sqrt", "rsqrt", "norm", "std", "var", "vector_norm"})


def _fragile_divisor(divisor: ast.AST) -> bool:
    """A divisor that goes wrong in 16 bits: one with a tiny epsilon added (1e-8 is 0 in fp16,
    1 + 1e-6 is 1 in bf16), or a norm/std/sqrt (a sum of squares that overflows fp16).
    A masked mean's ``/ mask.sum()`` is not fragile."""
    for node in ast.walk(divisor):
        if isinstance(node, ast.Constant) and isinstance(node.value, float) and 0 < node.value < 1e-3:
            return True
        if isinstance(node, ast.Name) and "eps" in node.id.lower():
            return True
        if isinstance(node, ast.Attribute) and "eps" in node.attr.lower():
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _FRAGILE_CALLS:
                return True
    return False


def _uses_sensitive_op(script: Script, body: ast.AST) -> bool:
    for node in ast.walk(body):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _SENSITIVE:
                q = script.qualname(func)
                if q is None or q.startswith("torch."):  # tensor method or torch.<op>
                    return True
            q = script.qualname(func) if isinstance(func, ast.Name) else None
            if q and q.startswith("torch.") and q.split(".")[-1] in _SENSITIVE:
                return True
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            exponent = node.args[-1] if name == "pow" and node.args else None
            if exponent is not None and not isinstance(exponent, ast.Constant):
                return True
        elif isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow) and not isinstance(node.right, ast.Constant):
                return True
            if isinstance(node.op, ast.Div) and _fragile_divisor(node.right):
                return True
    return False


def _upcasts(script: Script, func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func
        if isinstance(callee, ast.Attribute) and callee.attr in ("float", "double") and not node.args:
            return True
        if isinstance(callee, ast.Attribute) and callee.attr in ("to", "type"):
            if any(script.dtype(a) in ("fp32", "fp64") for a in node.args):
                return True
        if any(kw.arg == "dtype" and script.dtype(kw.value) in ("fp32", "fp64") for kw in node.keywords):
            return True
        if any(kw.arg == "cast_inputs" for kw in node.keywords):
            return True
        region = script.autocast(node)
        if region is not None and region.enabled is False:
            return True
    return False


def _sensitive(script: Script, func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return _uses_sensitive_op(script, func) and not _upcasts(script, func)


class SensitiveLosses:
    """Answers "is this call a sensitive custom loss?" for one file."""

    def __init__(self, script: Script):
        self.script = script
        self.functions = {
            name
            for name, defs in script.functions.items()
            if "loss" in name.lower() and len(defs) == 1 and _sensitive(script, defs[0])
        }
        self.methods = {
            name
            for name, defs in script.methods.items()
            if "loss" in name.lower() and len(defs) == 1 and _sensitive(script, defs[0])
        }
        self.classes = set()
        for name, cls in script.classes.items():
            forward = [
                f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "forward"
            ]
            if "loss" in name.lower() and forward and _sensitive(script, forward[0]):
                self.classes.add(name)
        self.instances = {
            k
            for k, values in script.assigns.items()
            if len(values) == 1 and self._constructs(values[0])
        }

    def _constructs(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.classes

    def name_of(self, call: ast.Call) -> str | None:
        """The loss's name when ``call`` calls a sensitive custom loss, else None."""
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.functions:
            return func.id
        if self._constructs(func):
            return func.func.id
        if isinstance(func, ast.Attribute) and key_of(func.value) == "self" and func.attr in self.methods:
            return func.attr
        k = key_of(func)
        if k in self.instances:
            return k
        return None
