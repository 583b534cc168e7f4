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

Where it runs matters: CUDA autocast runs log, exp, pow, rsqrt, reciprocal, logsumexp and the
norms in fp32 (its fp32 list), so under it only ``sqrt``, ``std``/``var``, a division by an
epsilon-guarded value whose epsilon fp16 cannot hold (or whose value is not written), and, under
fp16, an epsilon below fp16's range (``log(p + 1e-8)``) stay 16-bit. CPU autocast's fp32 list has
none of these ops: there every one above counts. ``x.log(...)`` with arguments, or on ``self``
or a logger, is a logging call, not the tensor op.

Library losses (``F.cross_entropy``, ``nn.MSELoss``) are never sensitive here: autocast already
runs them in fp32.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from mixprec.lint.dtypes import autocast as autocast_of
from mixprec.lint.dtypes import one_dtype
from mixprec.lint.names import Script, key_of

_SENSITIVE = frozenset(
    {"log", "log1p", "log2", "log10", "exp", "expm1", "logsumexp", "sqrt", "rsqrt", "reciprocal"}
)
_FRAGILE_CALLS = frozenset({"sqrt", "rsqrt", "norm", "std", "var", "vector_norm"})


# On CUDA, autocast runs these in fp32 whatever their inputs (its fp32 list): a loss made of
# them is not 16-bit there. CPU autocast's fp32 list has none of them.
_CUDA_FP32 = frozenset({"log", "log1p", "log2", "log10", "exp", "expm1", "logsumexp", "reciprocal", "rsqrt", "pow"})
_NO_ARGS = frozenset({"log", "log1p", "log2", "log10", "exp", "expm1", "sqrt", "rsqrt", "reciprocal"})
_FP16_TINY = 6e-8  # below fp16's smallest subnormal (5.96e-8): added to 0 it is 0
_CUDA_FRAGILE_CALLS = frozenset({"sqrt", "std", "var"})  # norms are on CUDA's fp32 list, these are not


@dataclass(frozen=True)
class Sensitivity:
    """Where a loss's arithmetic goes wrong in 16 bits: under CPU autocast, under CUDA autocast
    (any 16-bit dtype), and under CUDA autocast in fp16 only (an epsilon fp16 cannot hold)."""

    cpu: bool = False
    cuda: bool = False
    cuda_fp16: bool = False

    def __bool__(self) -> bool:
        return self.cpu or self.cuda or self.cuda_fp16

    def under(self, device: str | None, dtype: str | None) -> bool:
        """Whether the loss is 16-bit-sensitive under an autocast on ``device`` in ``dtype``
        (None: unknown; an unknown device is judged by CUDA's list, which upcasts more)."""
        if device == "cpu":
            return self.cpu
        return self.cuda or (self.cuda_fp16 and dtype == "fp16")


def _small(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e-3 else None


def _epsilons(divisor: ast.AST) -> list[float | None]:
    """The epsilons in an expression: small literals, and None for a name like ``eps`` whose
    value is not written there."""
    out: list[float | None] = []
    for node in ast.walk(divisor):
        if isinstance(node, ast.Constant) and _small(node.value) is not None:
            out.append(float(node.value))
        elif isinstance(node, ast.Name) and "eps" in node.id.lower():
            out.append(None)
        elif isinstance(node, ast.Attribute) and "eps" in node.attr.lower():
            out.append(None)
    return out


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _fragile_divisor(divisor: ast.AST, cuda: bool) -> bool:
    """A divisor that goes wrong in 16 bits: one with a tiny epsilon added (1e-8 is 0 in fp16,
    1 + 1e-6 is 1 in bf16), or a norm/std/sqrt (a sum of squares that overflows fp16). A masked
    mean's ``/ mask.sum()`` is not fragile. Under CUDA autocast norms run in fp32, and only an
    epsilon below fp16's range (or one whose value is not written there) is lost."""
    for eps in _epsilons(divisor):
        if not cuda or eps is None or eps < _FP16_TINY:
            return True
    calls = _CUDA_FRAGILE_CALLS if cuda else _FRAGILE_CALLS
    return any(isinstance(n, ast.Call) and _call_name(n) in calls for n in ast.walk(divisor))


def _tensor_op(script: Script, node: ast.Call) -> str | None:
    """The name of the tensor op a call runs (``torch.log(x)``, ``x.log()``), or None: a call of
    a non-torch module's function, or a method that takes arguments the tensor op does not
    (``self.logger.log({...})``, Lightning's ``self.log("loss", v)``)."""
    func = node.func
    if isinstance(func, ast.Attribute):
        q = script.qualname(func)
        if q is not None:
            return func.attr if q.startswith("torch.") else None
        receiver = key_of(func.value)
        if receiver == "self" or (receiver and any(w in receiver.lower() for w in ("log", "writer", "wandb", "tracker"))):
            return None
        if func.attr in _NO_ARGS and (node.args or any(kw.arg != "out" for kw in node.keywords)):
            return None
        return func.attr
    q = script.qualname(func) if isinstance(func, ast.Name) else None
    return q.split(".")[-1] if q and q.startswith("torch.") else None


def _defaults(func: ast.AST) -> dict[str, object]:
    """Parameter -> its literal default (``eps=1e-8``)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    a = func.args
    positional = [*a.posonlyargs, *a.args]
    pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
    pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    return {p.arg: d.value for p, d in pairs if isinstance(d, ast.Constant)}


def _sensitivity(script: Script, body: ast.AST) -> Sensitivity:
    cpu = cuda = cuda_fp16 = False
    defaults = _defaults(body)
    for node in ast.walk(body):
        if isinstance(node, ast.Call):
            op = _tensor_op(script, node)
            if op == "pow" and node.args and not isinstance(node.args[-1], ast.Constant):
                cpu = True
            elif op in _SENSITIVE:
                cpu = True
                cuda |= op not in _CUDA_FP32
        elif isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow) and not isinstance(node.right, ast.Constant):
                cpu = True  # ``**`` is pow: on CUDA's fp32 list
            if isinstance(node.op, ast.Div) and _fragile_divisor(node.right, cuda=False):
                cpu = True
                cuda |= _fragile_divisor(node.right, cuda=True)
            if isinstance(node.op, ast.Add):  # log(p + 1e-8): the epsilon is 0 in fp16
                for side in (node.left, node.right):
                    value = side.value if isinstance(side, ast.Constant) else (
                        defaults.get(side.id, script.constant(side)) if isinstance(side, ast.Name) else None)
                    if _small(value) is not None and value < _FP16_TINY:
                        cuda_fp16 = cpu = True
    return Sensitivity(cpu, cuda, cuda_fp16)


def _upcasts(script: Script, func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func
        if isinstance(callee, ast.Attribute) and callee.attr in ("float", "double") and not node.args:
            return True
        if isinstance(callee, ast.Attribute) and callee.attr in ("to", "type"):
            if any(one_dtype(script, a) in ("fp32", "fp64") for a in node.args):
                return True
        if any(kw.arg == "dtype" and one_dtype(script, kw.value) in ("fp32", "fp64") for kw in node.keywords):
            return True
        if any(kw.arg == "cast_inputs" for kw in node.keywords):
            return True
        region = autocast_of(script, node)
        if region is not None and region.enabled is False:
            return True
    return False


def _sensitive(script: Script, func: ast.FunctionDef | ast.AsyncFunctionDef) -> Sensitivity:
    return Sensitivity() if _upcasts(script, func) else _sensitivity(script, func)


class SensitiveLosses:
    """Answers "is this call a sensitive custom loss?" for one file."""

    def __init__(self, script: Script):
        self.script = script
        self.sensitivity: dict[str, Sensitivity] = {}  # loss name -> where it is sensitive
        self.functions, self.methods, self.classes = set(), set(), set()
        for kind, table in ((self.functions, script.functions), (self.methods, script.methods)):
            for name, defs in table.items():
                if "loss" in name.lower() and len(defs) == 1:
                    found = _sensitive(script, defs[0])
                    if found:
                        kind.add(name)
                        self.sensitivity[name] = found
        for name, cls in script.classes.items():
            forward = [
                f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "forward"
            ]
            if "loss" in name.lower() and forward:
                found = _sensitive(script, forward[0])
                if found:
                    self.classes.add(name)
                    self.sensitivity[name] = found
        self.instances = {
            k
            for k, values in script.assigns.items()
            if len(values) == 1 and self._constructs(values[0])
        }
        for k in self.instances:
            self.sensitivity[k] = self.sensitivity[script.assigns[k][0].func.id]

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
