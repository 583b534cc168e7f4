"""MP106's sources of 16-bit weights beyond a plain cast (``casts.py`` holds the rule): casts that do not look
like one (each parameter in a loop, ``model.apply(fn)``, a helper of the file that does either, CLIP's
``convert_weights`` and ``clip.load``) and a model built while ``torch.set_default_dtype`` makes new tensors
16-bit. Also the cast primitives both modules share (``Cast``, ``_cast``).

``IndirectCasts`` and ``DefaultDtypes`` are mixins of ``casts.HalfModels``: they use its ``script`` and, for
the default dtype, its ``_bindings``, ``_keeps``, ``_rebinds`` and ``_exempt``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from mixprec.lint.dtypes import dtypes as dtypes_of
from mixprec.lint.names import Script, argument, key_of
from mixprec.lint.report import Hit
from mixprec.lint.savers import definition_of

_SIXTEEN = frozenset({"fp16", "bf16"})
_TENSOR_TYPES = {"torch.HalfTensor": "fp16", "torch.cuda.HalfTensor": "fp16", "torch.BFloat16Tensor": "bf16",
                 "torch.cuda.BFloat16Tensor": "bf16", "torch.FloatTensor": "fp32", "torch.cuda.FloatTensor": "fp32",
                 "torch.DoubleTensor": "fp64", "torch.cuda.DoubleTensor": "fp64"}
_UPCASTS = frozenset({"float", "double"})
_MODULE_LOOPS = frozenset({"parameters", "named_parameters", "modules", "named_modules", "children", "named_children"})
# Library calls that cast a model's weights to fp16 in place (argument index), or return such a model
_KNOWN_CASTERS = {"clip.model.convert_weights": 0, "clip.convert_weights": 0}  # OpenAI CLIP
_KNOWN_HALF_BUILDERS = {"clip.load": "is loaded with fp16 weights by clip.load (on any device but the CPU)"}


@dataclass(frozen=True)
class Cast:
    key: str
    call: ast.Call  # the casting call (reported there)
    stmt: ast.stmt
    in_place: bool  # model.half() / model.to(...) on the module itself, as opposed to from_pretrained
    dtypes: frozenset
    dtype_text: str  # when a run-time dtype is 16-bit: "weight_dtype is 16-bit", "cfg.use_fp16"
    what: str = "is cast to 16 bits"  # how the message says it became 16-bit


def _cast(script: Script, node: ast.AST) -> tuple[ast.Call, frozenset, str] | None:
    """(the call, its possible dtypes, when it is 16-bit as the message says it) in a chain like
    ``Net().to(dev).half()`` that may cast to fp16/bf16."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        if method in ("half", "bfloat16") and not node.args:
            return node, frozenset({"fp16" if method == "half" else "bf16"}), f".{method}()"
        candidates, read = [], dtypes_of
        if method in ("from_pretrained", "from_config"):
            candidates = [kw.value for kw in node.keywords if kw.arg in ("torch_dtype", "dtype")]
            read = _loaded_dtypes
        elif method in ("to", "type"):
            candidates = [*node.args, *(kw.value for kw in node.keywords if kw.arg == "dtype")]
        for candidate in candidates:
            found = read(script, candidate)
            if found is not None and found & _SIXTEEN:
                return node, found, _when_sixteen(script, candidate, read)
        node = node.func.value
    return None


def _loaded_dtypes(script: Script, node: ast.AST, depth: int = 0) -> frozenset | None:
    """The dtypes of ``from_pretrained(torch_dtype=node)``, where ``"auto"`` (the checkpoint's
    dtype) and ``None`` (the default) are possible too, as "auto": ``torch.float16 if
    cfg.use_fp16 else "auto"`` is {"fp16", "auto"}, where ``dtypes`` alone knows nothing, and
    the fp16 arm went unreported (found by a probe of real scripts, llama-recipes)."""
    if isinstance(node, ast.Constant) and (node.value is None or node.value == "auto"):
        return frozenset({"auto"})
    if isinstance(node, ast.IfExp) and depth < 4:
        arms = [_loaded_dtypes(script, node.body, depth + 1), _loaded_dtypes(script, node.orelse, depth + 1)]
        return None if None in arms else arms[0] | arms[1]
    return dtypes_of(script, node)


def _when_sixteen(script: Script, node: ast.AST, read) -> str:
    """When a dtype chosen at run time is 16-bit, for the message: ``weight_dtype is 16-bit``,
    or the test itself for ``torch.float16 if cfg.use_fp16 else torch.float32``, which read
    "when torch.float16 if cfg.use_fp16 else torch.float32 is 16-bit" (found by a probe of real
    scripts)."""
    if isinstance(node, ast.IfExp):
        body, orelse = read(script, node.body), read(script, node.orelse)
        test = ast.unparse(node.test)
        if body is not None and orelse is not None and not orelse & _SIXTEEN:
            return test
        if body is not None and orelse is not None and not body & _SIXTEEN:
            return f"not {test}" if isinstance(node.test, (ast.Name, ast.Attribute, ast.Call)) else f"not ({test})"
    return f"{ast.unparse(node)} is 16-bit"


def _base_name(node: ast.AST) -> str | None:
    """``l`` for ``l.weight.data``; None when the chain does not start at a plain name."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return node


class IndirectCasts:
    """Casts that do not look like one: per parameter, through ``apply()``, by a helper."""

    script: Script

    def _indirect_casts(self) -> list[Cast]:
        """``for p in model.parameters(): p.data = p.data.half()`` (or over ``modules()``),
        ``model.apply(fn)`` with an ``fn`` that casts its module, ``convert_weights(model)`` (a helper of the
        file that does either, or OpenAI CLIP's), and ``model, _ = clip.load(...)``."""
        script, out = self.script, []
        for node in script.nodes:
            if isinstance(node, ast.For):
                found = self._loop_cast(node)
                if found is not None:
                    k, (call, kinds, text) = found
                    out.append(Cast(k, call, node, True, kinds, text, "has its weights cast to 16 bits one by one"))
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                found = self._call_cast(node.value)
                if found is not None:
                    k, kinds, text, how = found
                    out.append(Cast(k, node.value, node, True, kinds, text, f"is cast to 16 bits by {how}"))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call):
                text = _KNOWN_HALF_BUILDERS.get(script.qualname(node.value.func) or "")
                if text is None:
                    continue
                device = argument(node.value, 1, "device")
                if isinstance(device, ast.Constant) and device.value == "cpu":
                    continue  # clip.load(..., device="cpu") returns fp32 weights
                target = node.targets[0]
                k = key_of(target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target)
                if k is not None:
                    out.append(Cast(k, node.value, node, False, frozenset({"fp16"}), "clip.load", text))
        return out

    def _data_cast(self, node: ast.AST) -> tuple[str, tuple[ast.Call, frozenset, str]] | None:
        """(root name, the cast) for ``x.weight.data = <16-bit cast>`` or ``m.half()`` / ``m.to(torch.bfloat16)``."""
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and target.attr == "data":
                found = _cast(self.script, node.value)
                root = _base_name(target)
                if found is not None and root is not None:
                    return root, found
        elif isinstance(node, ast.Expr):
            found = _cast(self.script, node.value)
            if found is not None:
                root = _base_name(_root(found[0]))
                if root is not None:
                    return root, found
        return None

    def _loop_cast(self, loop: ast.For) -> tuple[str, tuple[ast.Call, frozenset, str]] | None:
        """(model key, the cast) for a loop over a model's parameters or modules that casts each."""
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in _MODULE_LOOPS):
            return None
        k = key_of(it.func.value)
        target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) and loop.target.elts else loop.target
        if k is None or not isinstance(target, ast.Name):
            return None
        for node in ast.walk(loop):
            found = self._data_cast(node)
            if found is not None and found[0] == target.id:
                return k, found[1]
        return None

    def _call_cast(self, call: ast.Call) -> tuple[str, frozenset, str] | None:
        """(model key, dtypes, dtype text, what casts it) for ``model.apply(fn)`` with a casting ``fn``, or a
        helper call that casts its argument in place."""
        script = self.script
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "apply" and len(call.args) == 1:
            k, fn = key_of(func.value), call.args[0]
            if k is None:
                return None
            if isinstance(fn, ast.Lambda) and fn.args.args:
                found = _cast(script, fn.body)
                if found is not None and _base_name(_root(found[0])) == fn.args.args[0].arg:
                    return k, found[1], found[2], f"{k}.apply"
                return None
            if isinstance(fn, ast.Name):
                defs = script.functions.get(fn.id, [])
                if len(defs) == 1 and defs[0].args.args:
                    cast = self.casting_params(defs[0]).get(defs[0].args.args[0].arg)
                    if cast is not None:
                        return k, cast[0], cast[1], f"{k}.apply({fn.id})"
            return None
        index = _KNOWN_CASTERS.get(script.qualname(func) or "")
        if index is not None:
            k = key_of(argument(call, index, "model"))
            return None if k is None else (k, frozenset({"fp16"}), "fp16", ast.unparse(func))
        found = definition_of(script, call)
        if found is None or found[1] is not script:
            return None
        casts = self.casting_params(found[0])
        names = [p.arg for p in (*found[0].args.posonlyargs, *found[0].args.args)]
        for index, name in enumerate(names):
            if name in casts:
                k = key_of(argument(call, index, name))
                if k is not None:
                    return k, casts[name][0], casts[name][1], ast.unparse(func)
        return None

    def casting_params(self, func) -> dict[str, tuple[frozenset, str]]:
        """The parameters of ``func`` (a def of this file) whose weights it casts to 16 bits in place, with
        the cast's dtypes and text: directly, per parameter or module in a loop, or through ``apply``."""
        memo = self.__dict__.setdefault("_casting", {})
        if id(func) in memo:
            return memo[id(func)]
        memo[id(func)] = {}  # a recursive helper casts nothing more by calling itself
        names = {p.arg for p in (*func.args.posonlyargs, *func.args.args)}
        out: dict[str, tuple[frozenset, str]] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.For):
                found = self._loop_cast(node)
                if found is not None and found[0].split(".")[0] in names:
                    out.setdefault(found[0].split(".")[0], found[1][1:])
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                via = self._call_cast(node.value)
                if via is not None and via[0].split(".")[0] in names:
                    out.setdefault(via[0].split(".")[0], via[1:3])
            found = self._data_cast(node)
            if found is not None and found[0] in names:
                out.setdefault(found[0], found[1][1:])
        memo[id(func)] = out
        return out


class DefaultDtypes:
    """A model built while ``torch.set_default_dtype`` makes new tensors 16-bit."""

    script: Script

    def default_dtypes(self) -> list[tuple[ast.Call, frozenset | None, str]]:
        """Each ``torch.set_default_dtype(d)`` / ``set_default_tensor_type(t)`` call: (call, the dtypes it
        may set, or None when unknown, the argument as written)."""
        out = []
        for call in self.script.calls:
            q = self.script.qualname(call.func)
            if q == "torch.set_default_dtype":
                arg = argument(call, 0, "d")
                if arg is not None:
                    out.append((call, dtypes_of(self.script, arg), ast.unparse(arg)))
            elif q == "torch.set_default_tensor_type":
                arg = argument(call, 0, "t")
                if arg is None:
                    continue
                name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else self.script.qualname(arg)
                kind = _TENSOR_TYPES.get(name or "")
                out.append((call, None if kind is None else frozenset({kind}), ast.unparse(arg)))
        return out

    def _upcasts(self, node: ast.AST | None) -> bool:
        """A call chain with ``.float()``, ``.double()`` or ``.to(torch.float32)`` in it."""
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in _UPCASTS and not node.args:
                return True
            if method in ("to", "type") and any((dtypes_of(self.script, a) or frozenset()) - _SIXTEEN
                                                for a in (*node.args, *(kw.value for kw in node.keywords))):
                return True
            node = node.func.value
        return False

    def _upcast_between(self, k: str, after: ast.AST, before: ast.AST) -> bool:
        """``k.float()`` / ``k.to(torch.float32)`` called on ``k`` between the two, in their scope."""
        return any(after.lineno < c.lineno < before.lineno and isinstance(c.func, ast.Attribute)
                   and key_of(_root(c)) == k and self.script.same_scope(c, after, k) and self._upcasts(c)
                   for c in self.script.calls)

    def _built_under(self, call: ast.Call, resets: list[ast.Call], k: str, opt: ast.Call) -> ast.stmt | None:
        """The statement that built the module ``opt`` trains (its last binding before ``opt`` that does not keep
        older parameters), when it ran under the 16-bit default ``call`` set: after it, in its function (or
        ``call`` at module level), with no reset between and no cast back to fp32 before ``opt``."""
        script, bindings = self.script, self._bindings()
        root = k if k.startswith("self.") else k.split(".")[0]
        binds = sorted({id(b): b for b in bindings.get(k, []) + bindings.get(root, [])}.values(), key=lambda b: b.lineno)
        build = None
        for b in reversed([b for b in binds if b.lineno < opt.lineno and script.same_scope(b, opt, k)]):
            value = getattr(b, "value", None)
            if self._upcasts(value):
                return None  # model = model.float(): fp32 again
            if not self._keeps(k, value):
                build = b
                break
        at = script.owner(call)
        if build is None or build.lineno <= call.lineno or (at is not None and script.owner(build) is not at):
            return None
        if any(call.lineno < r.lineno < build.lineno for r in resets):
            return None  # the default was fp32 again when the module was built
        if self._upcast_between(k, build, opt) or self._exempt(k, opt):
            return None
        return build

    def default_dtype_hits(self, trained: dict[str, list[tuple[ast.Call, set]]]) -> list[Hit]:
        sets = self.default_dtypes()
        resets = [c for c, d, _ in sets if d is not None and not d & _SIXTEEN]
        hits = []
        for call, kinds, text in sets:
            if kinds is None or not kinds & _SIXTEEN:
                continue
            found = next(((k, b, opt) for k, opts in trained.items() for opt, _ in opts
                          if (b := self._built_under(call, resets, k, opt)) is not None), None)
            if found is None:
                continue
            k, build, opt = found
            when = "" if kinds <= _SIXTEEN else f" when {text} is 16-bit"
            hits.append(Hit("MP106", call, (
                f"torch.{call.func.attr}({text}) makes new tensors 16-bit{when}: {k} is built under it "
                f"(line {build.lineno}) and its parameters are given to the optimizer (line {opt.lineno}): "
                "no fp32 master weights")))
        return hits
