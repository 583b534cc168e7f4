"""MP106: a model cast to 16 bits whose parameters a ``torch.optim`` optimizer updates.

A cast is ``.half()``, ``.bfloat16()``, ``.to(dtype)`` / ``.type(dtype)`` with a 16-bit dtype, or
``from_pretrained(..., torch_dtype=...)``, on a model key (``model``, ``self.net``); the dtype may
be a run-time choice (``weight_dtype`` set to fp32, fp16 or bf16 from a flag), which is reported
as such ("when weight_dtype is 16-bit"). The optimizer trains the model when it is built over
``model.parameters()`` / ``named_parameters()`` (or a sub-module's), directly, through a name
(``params = filter(lambda p: p.requires_grad, model.parameters())``), in parameter groups, or
through a function of the file or the project that does so with its argument
(``optimizer = build_optimizer(cfg, model)``); its class is a ``torch.optim`` one, or a name that
may be one (``optimizer_class = bnb.optim.AdamW8bit if args.use_8bit else torch.optim.AdamW``).

It is a trap when, in one scope, the optimizer is built after the cast with no rebinding of the
model in between that may change its parameters (``model = get_peft_model(model)``, ``model,
opt = accelerator.prepare(...)``), or the cast is in place and comes after the optimizer was built
(``vae.to(device, dtype=weight_dtype)`` after ``AdamW(vae.parameters())``: the optimizer's
parameters are the cast ones). Rebindings that keep the parameters do not count: ``model =
model.cuda()``, ``model = model.to(device)``, ``model = DDP(model)``, ``torch.compile(model)``.

Casts that do not look like one count too: each parameter in a loop (``p.data = p.data.half()``, or
``m.half()`` over ``model.modules()``), ``model.apply(fn)`` with an ``fn`` that casts its module, a helper of
the file that does either (``convert_weights(model)``; OpenAI CLIP's ``clip.model.convert_weights`` too),
and ``model, preprocess = clip.load(...)`` unless ``device="cpu"`` (CLIP's weights are fp16 elsewhere).

A model built while ``torch.set_default_dtype(torch.bfloat16)`` (or ``float16``, or
``torch.set_default_tensor_type(torch.cuda.HalfTensor)``) is in force has 16-bit parameters too: it is
reported when the call is at module level or in the function that binds the model, the model is bound
after it with no reset to fp32 in between, and a torch optimizer is built over its parameters later
with no cast back to fp32 (``model = model.float()``, ``model.to(torch.float32)``) in between.

Silent when the file uses a library that keeps master weights itself (apex, DeepSpeed, mixprec),
when the model gets adapters whose parameters are upcast (``cast_training_params``,
``add_adapter``, ``get_peft_model``), and when it goes through an Accelerate set-up with FSDP or
DeepSpeed (which upcast the trained parameters to fp32).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from mixprec.lint.dtypes import dtypes as dtypes_of
from mixprec.lint.dtypes import values
from mixprec.lint.names import Script, argument, key_of, normalized_test
from mixprec.lint.report import Hit
from mixprec.lint.savers import definition_of

_STRATEGY_LIBS = frozenset({"apex", "mixprec", "deepspeed"})  # own master weights / step order
_SIXTEEN = frozenset({"fp16", "bf16"})
_KEEPS = frozenset({"cuda", "cpu", "to", "train", "eval", "requires_grad_", "share_memory", "xpu", "npu", "half",
                    "bfloat16", "apply", "zero_grad"})
_WRAPPERS = frozenset({
    "torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.compile",
})
_ADAPTERS = frozenset({"cast_training_params", "add_adapter", "get_peft_model", "inject_adapter_in_model",
                       "prepare_model_for_kbit_training", "load_adapter"})
_COPIES = frozenset({"float", "double", "detach", "clone", "to", "type", "new_tensor", "copy_"})
_SHARDING_PLUGINS = frozenset({"fsdp_plugin", "deepspeed_plugin", "parallelism_config"})
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
    dtype_text: str
    what: str = "is cast to 16 bits"  # how the message says it became 16-bit


def _cast(script: Script, node: ast.AST) -> tuple[ast.Call, frozenset, str] | None:
    """(the call, its possible dtypes, the dtype as written) in a chain like
    ``Net().to(dev).half()`` that may cast to fp16/bf16."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        if method in ("half", "bfloat16") and not node.args:
            return node, frozenset({"fp16" if method == "half" else "bf16"}), f".{method}()"
        candidates = []
        if method in ("from_pretrained", "from_config"):
            candidates = [kw.value for kw in node.keywords if kw.arg in ("torch_dtype", "dtype")]
        elif method in ("to", "type"):
            candidates = [*node.args, *(kw.value for kw in node.keywords if kw.arg == "dtype")]
        for candidate in candidates:
            found = dtypes_of(script, candidate)
            if found is not None and found & _SIXTEEN:
                return node, found, ast.unparse(candidate)
        node = node.func.value
    return None


def _conjuncts(test: ast.expr, holds: bool) -> set[tuple[str, bool]]:
    """(test, polarity) facts an ``if`` arm establishes: ``not a and b`` holding gives (a,
    False) and (b, True); the other arm of an ``and`` establishes nothing certain."""
    test, positive = normalized_test(test)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and holds == positive:
        return set().union(*(_conjuncts(v, True) for v in test.values))
    if isinstance(test, ast.BoolOp):
        return set()
    return {(ast.dump(test), positive == holds)}


def conditions(script: Script, node: ast.AST, stop: ast.AST | None = None) -> set[tuple[str, bool]]:
    """The facts the ``if`` statements and conditional expressions around ``node`` establish
    where it runs (up to ``stop`` included, or its function)."""
    facts: set[tuple[str, bool]] = set()
    if node is stop:
        return facts
    child, current = node, script.parent(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(current, ast.If) and child is not current.test:
            facts |= _conjuncts(current.test, any(child is s for s in current.body))
        elif isinstance(current, ast.IfExp) and child is not current.test:
            facts |= _conjuncts(current.test, child is current.body)
        if current is stop:
            break
        child, current = current, script.parent(current)
    return facts


def _clash(a: set, b: set) -> bool:
    return any((text, not holds) in b for text, holds in a)


def _base_name(node: ast.AST) -> str | None:
    """``l`` for ``l.weight.data``; None when the chain does not start at a plain name."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return node


class HalfModels:
    def __init__(self, script: Script):
        self.script = script
        self._binds: dict[str, list[ast.stmt]] | None = None  # key -> statements that bind it
        self._special: list[ast.Call] | None = None  # adapter and prepare calls

    def casts(self) -> list[Cast]:
        script, out = self.script, []
        for node in script.nodes:
            if isinstance(node, ast.Expr):  # model.half(), model.to(dev, dtype=d): modules cast in place
                found = _cast(script, node.value)
                k = key_of(_root(found[0])) if found else None
                in_place = True
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                found = _cast(script, node.value)
                k = key_of(node.targets[0])
                in_place = found is not None and key_of(_root(found[0])) == k
            else:
                continue
            if found is not None and k is not None:
                call, kinds, text = found
                out.append(Cast(k, call, node, in_place, kinds, text))
        return out + self._indirect_casts()

    # --- casts that do not look like one: per parameter, through apply(), by a helper -----------

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
                device = argument(node.value, 1, "device")
                if isinstance(device, ast.Constant) and device.value == "cpu":
                    continue  # clip.load(..., device="cpu") returns fp32 weights
                target = node.targets[0]
                first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                k = key_of(first)
                if text is not None and k is not None:
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

    # --- what the optimizers train -------------------------------------------------------

    def is_optimizer_class(self, func: ast.AST) -> bool:
        script = self.script
        if (script.qualname(func) or "").startswith("torch.optim."):
            return True
        bound = values(script, func) if isinstance(func, (ast.Name, ast.Attribute)) else None
        arms = []
        for value in bound or ():
            while isinstance(value, ast.IfExp):  # bnb.optim.AdamW8bit if args.use_8bit_adam else torch.optim.AdamW
                arms.append(value.body)
                value = value.orelse
            arms.append(value)
        return any((script.qualname(v) or "").startswith("torch.optim.") for v in arms)

    def trained(self) -> list[tuple[str, ast.Call, set]]:
        """(model key, optimizer construction, facts that hold where the optimizer gets its
        parameters) for each optimizer over a model's parameters."""
        out = []
        for call in self.script.calls:
            if self.is_optimizer_class(call.func):
                params = argument(call, 0, "params")
                for k, facts in self._models(params, call, 0):
                    out.append((k, call, facts | conditions(self.script, call)))
            else:
                for k in self._builder(call):
                    out.append((k, call, conditions(self.script, call)))
        return out

    def _models(self, expr: ast.AST | None, at: ast.AST, depth: int) -> list[tuple[str, set]]:
        """(key, facts) for each model whose ``.parameters()`` ``expr`` is built from (through
        names, three deep), with what must hold for that model to be in it."""
        found: list[tuple[str, set]] = []
        if expr is None or depth > 3:
            return found
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _COPIES for n in ast.walk(expr)):
            return found  # [p.detach().clone().float() for p in model.parameters()]: fp32 masters, not the model's
        for node in ast.walk(expr):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("parameters", "named_parameters"):
                k = key_of(node.func.value)
                if k is not None:
                    found.append((k, conditions(self.script, node, stop=expr)))
            elif isinstance(node, ast.Call):  # get_trainable_params(model): a helper returning its parameters
                for k in self._call_args(node, self._returned_params(node)):
                    found.append((k, conditions(self.script, node, stop=expr)))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                for value in values(self.script, node) or []:
                    if value is not expr:
                        facts = conditions(self.script, value) | conditions(self.script, node, stop=expr)
                        found.extend((k, f | facts) for k, f in self._models(value, at, depth + 1))
        return found

    def _returned_params(self, call: ast.Call) -> frozenset[str]:
        """The parameters of the function ``call`` calls whose ``.parameters()`` it returns."""
        found = definition_of(self.script, call)
        if found is None:
            return frozenset()
        func, home = found
        project = self.script.project
        memo = project.memo if project is not None else {}
        key = ("returns-parameters", id(func))
        if key not in memo:
            names = {p.arg for p in (*func.args.posonlyargs, *func.args.args)}
            out = set()
            for node in ast.walk(func):
                if isinstance(node, ast.Return) and node.value is not None:
                    for n in ast.walk(node.value):
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                                n.func.attr in ("parameters", "named_parameters"):
                            root = (key_of(n.func.value) or "").split(".")[0]
                            if root in names:
                                out.add(root)
            memo[key] = frozenset(out)
        return memo[key]

    def _call_args(self, call: ast.Call, wanted: frozenset[str]) -> set[str]:
        """Keys of the arguments ``call`` passes for the parameters ``wanted`` of its callee."""
        if not wanted:
            return set()
        func, _ = definition_of(self.script, call)
        names = [p.arg for p in (*func.args.posonlyargs, *func.args.args)]
        out = set()
        for index, name in enumerate(names):
            if name not in wanted:
                continue
            arg = next((kw.value for kw in call.keywords if kw.arg == name), None)
            if arg is None and index < len(call.args):
                arg = call.args[index]
            k = key_of(arg) if arg is not None else None
            if k is not None:
                out.add(k)
        return out

    def _builder(self, call: ast.Call) -> set[str]:
        """Keys of the models whose parameters a function of the file or project, called here,
        gives to a torch optimizer it builds: ``setup_optimizer(unet, args)``."""
        found = definition_of(self.script, call)
        if found is None:
            return set()
        func, home = found
        project = self.script.project
        memo = project.memo if project is not None else {}
        key = ("optimizer-builder", id(func))
        if key not in memo:
            memo[key] = _builder_params(home, func)
        return self._call_args(call, memo[key])

    # --- the rule --------------------------------------------------------------------------

    def _trains_after(self, cast: Cast) -> bool:
        """Whether a backward() or a step runs after ``cast`` in its scope (a cast to save the
        weights after training is no trap)."""
        owner = self.script.owner(cast.call)
        return any(
            isinstance(c.func, ast.Attribute) and c.func.attr in ("step", "backward") and c.lineno > cast.stmt.lineno
            and self.script.owner(c) is owner
            for c in self.script.calls
        )

    def _exempt(self, k: str, at: ast.AST) -> bool:
        script = self.script
        if self._special is None:
            self._special = [c for c in script.calls if _name(c.func) in _ADAPTERS or _name(c.func) == "prepare"]
        for call in self._special:
            func = call.func
            name = _name(func)
            mentions = any(key_of(a) == k for a in (*call.args, *(kw.value for kw in call.keywords)))
            on_it = isinstance(func, ast.Attribute) and key_of(func.value) == k
            if name in _ADAPTERS and (mentions or on_it) and script.same_scope(call, at, k):
                return True
            if name == "prepare" and mentions and self._sharded(func):
                return True
        return False

    def _sharded(self, func: ast.AST) -> bool:
        """``accelerator.prepare`` of an Accelerator built with FSDP or DeepSpeed."""
        if not isinstance(func, ast.Attribute):
            return False
        for value in values(self.script, func.value) or []:
            if isinstance(value, ast.Call) and any(kw.arg in _SHARDING_PLUGINS for kw in value.keywords):
                return True
        return False

    def _bindings(self) -> dict[str, list[ast.stmt]]:
        """Key -> the statements that bind it (assignments), in file order."""
        if self._binds is None:
            self._binds = {}
            for node in self.script.nodes:
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for stored in {key_of(n) for t in targets for n in ast.walk(t)} - {None}:
                        self._binds.setdefault(stored, []).append(node)
        return self._binds

    def _rebinds(self, k: str, after: ast.AST, before: ast.AST) -> bool:
        """Whether ``k`` is bound again, between ``after`` and ``before`` in their scope, to
        something that may not keep its parameters."""
        script = self.script
        for node in self._bindings().get(k, ()):
            if after.lineno < node.lineno < before.lineno and script.same_scope(node, after, k):
                if not self._keeps(k, getattr(node, "value", None)):
                    return True
        return False

    def _keeps(self, k: str, value: ast.AST | None) -> bool:
        """``model.cuda()``, ``model.to(device)``, ``DDP(model)``: the same parameters, same dtype."""
        if value is None:
            return False
        if isinstance(value, ast.Call) and self.script.qualname(value.func) in _WRAPPERS:
            return bool(value.args) and (key_of(value.args[0]) == k or self._keeps(k, value.args[0]))
        node = value
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr not in _KEEPS:
                return False
            if node.func.attr in ("to", "type") and any(
                (dtypes_of(self.script, a) or frozenset()) - _SIXTEEN for a in (*node.args, *(kw.value for kw in node.keywords))
            ):
                return False  # back to fp32
            node = node.func.value
        return key_of(node) == k

    # --- the default dtype ------------------------------------------------------------------

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

    def default_dtype_hits(self, trained: dict[str, list[tuple[ast.Call, set]]]) -> list[Hit]:
        script = self.script
        sets = self.default_dtypes()
        sixteen = [(c, d, t) for c, d, t in sets if d is not None and d & _SIXTEEN]
        if not sixteen:
            return []
        resets = [c for c, d, _ in sets if d is not None and not d & _SIXTEEN]
        bindings = self._bindings()
        hits = []
        for call, kinds, text in sixteen:
            at = script.owner(call)
            found = None
            for k, opts in trained.items():
                root = k if k.startswith("self.") else k.split(".")[0]
                binds = sorted({id(b): b for b in bindings.get(k, []) + bindings.get(root, [])}.values(),
                               key=lambda b: b.lineno)
                for opt, _ in opts:
                    build = None  # the statement that made the trained module: the last binding before the
                    for b in reversed([b for b in binds if b.lineno < opt.lineno and script.same_scope(b, opt, k)]):
                        value = getattr(b, "value", None)  # optimizer that does not keep the old parameters
                        if self._upcasts(value):
                            break  # model = model.float(): fp32 again
                        if not self._keeps(k, value):
                            build = b
                            break
                    if build is None or build.lineno <= call.lineno or (at is not None and script.owner(build) is not at):
                        continue
                    if any(call.lineno < r.lineno < build.lineno for r in resets):
                        continue  # the default was fp32 again when the model was built
                    if self._upcast_between(k, build, opt) or self._exempt(k, opt):
                        continue
                    found = (k, build, opt)
                    break
                if found:
                    break
            if found:
                k, build, opt = found
                when = "" if kinds <= _SIXTEEN else f" when {text} is 16-bit"
                hits.append(Hit("MP106", call, (
                    f"torch.{call.func.attr}({text}) makes new tensors 16-bit{when}: {k} is built under it "
                    f"(line {build.lineno}) and its parameters are given to the optimizer (line {opt.lineno}): "
                    "no fp32 master weights")))
        return hits

    def hits(self) -> list[Hit]:
        script = self.script
        if script.imported_roots & _STRATEGY_LIBS:
            return []
        trained: dict[str, list[tuple[ast.Call, set]]] = {}
        for k, call, facts in self.trained():
            trained.setdefault(k, []).append((call, facts))
        hits = []
        for cast in sorted(self.casts(), key=lambda c: c.call.lineno):
            facts = conditions(script, cast.call)
            opts = [o for key, os_ in trained.items() if key == cast.key or key.startswith(cast.key + ".") for o in os_]
            # not in opposite arms: ``if not args.train_text_encoder: text_encoder.to(dtype)``
            opts = [o for o, f in opts if script.same_scope(cast.call, o, cast.key) and not _clash(facts, f)]
            if not opts or self._exempt(cast.key, cast.call):
                continue
            before = [o for o in opts if o.lineno > cast.stmt.lineno and not self._rebinds(cast.key, cast.stmt, o)
                      and not self._upcast_between(cast.key, cast.stmt, o)]
            after = [o for o in opts if o.lineno < cast.stmt.lineno] if cast.in_place and self._trains_after(cast) else []
            if not before and not after:
                continue
            when = "" if cast.dtypes <= _SIXTEEN else f" when {cast.dtype_text} is 16-bit"
            if before:
                message = (f"{cast.key} {cast.what}{when} and its parameters are given to the optimizer: "
                           f"no fp32 master weights")
            else:
                message = (f"{cast.key} {cast.what}{when} after its optimizer was built over its parameters "
                           f"(line {after[0].lineno}): the optimizer updates the 16-bit weights, no fp32 master copy")
            hits.append(Hit("MP106", cast.call, message))
        return hits + self.default_dtype_hits(trained)


def _builder_params(script: Script, func) -> frozenset[str]:
    """The parameters of ``func`` whose ``.parameters()`` reach a torch optimizer it builds."""
    half = HalfModels(script)
    by_owner = script.__dict__.get("_optimizers_by_owner")
    if by_owner is None:  # once per file: every torch optimizer construction, by the def around it
        by_owner = {}
        for call in script.calls:
            if half.is_optimizer_class(call.func):
                by_owner.setdefault(id(script.owner(call)), []).append(call)
        script.__dict__["_optimizers_by_owner"] = by_owner
    a = func.args
    names = {p.arg for p in (*a.posonlyargs, *a.args)}
    out: set[str] = set()
    for call in by_owner.get(id(func), ()):
        out |= {k.split(".")[0] for k, _ in half._models(argument(call, 0, "params"), call, 0)} & names
    return frozenset(out)


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def half_model_hits(script: Script) -> list[Hit]:  # MP106
    return HalfModels(script).hits()
