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

from mixprec.lint.dtypes import values
from mixprec.lint.hidden_casts import _SIXTEEN, Cast, DefaultDtypes, IndirectCasts, _cast, _root
from mixprec.lint.names import Script, argument, key_of, normalized_test
from mixprec.lint.report import Hit
from mixprec.lint.savers import definition_of

_STRATEGY_LIBS = frozenset({"apex", "mixprec", "deepspeed"})  # own master weights / step order
_KEEPS = frozenset({"cuda", "cpu", "to", "train", "eval", "requires_grad_", "share_memory", "xpu", "npu", "half",
                    "bfloat16", "apply", "zero_grad"})
_WRAPPERS = frozenset({
    "torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.compile",
})
# Set-ups that wrap the model and keep its parameters, dtype included: Fabric's setup_module/setup and
# Accelerate's prepare (unless a DeepSpeed or FSDP set-up is visible), FSDP given no mixed_precision.
# Read as rebindings that may change the parameters, they hid a .half() model (found by a probe of
# real scripts: lit-llama's fabric.setup_module, an FSDP(model) of a .half() model).
_FSDP = frozenset({"torch.distributed.fsdp.FullyShardedDataParallel",
                   "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"})
_FABRICS = frozenset({"lightning.Fabric", "lightning.fabric.Fabric", "lightning_fabric.Fabric",
                      "lightning.fabric.fabric.Fabric"})
_ADAPTERS = frozenset({"cast_training_params", "add_adapter", "get_peft_model", "inject_adapter_in_model",
                       "prepare_model_for_kbit_training", "load_adapter"})
_COPIES = frozenset({"float", "double", "detach", "clone", "to", "type", "new_tensor", "copy_"})
_SHARDING_PLUGINS = frozenset({"fsdp_plugin", "deepspeed_plugin", "parallelism_config"})


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


class HalfModels(IndirectCasts, DefaultDtypes):
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

    def _exempt(self, k: str, at: ast.AST, cast: bool = False) -> bool:
        """Whether ``k`` gets adapters upcast for training, or goes through a sharded Accelerate
        set-up. For a ``cast``, only adapters that come after it count: ``get_peft_model(unet)``
        and then ``unet.to(dtype=weight_dtype)`` casts the adapters too, and they are what the
        optimizer trains (found by a probe of real scripts)."""
        script = self.script
        if self._special is None:
            self._special = [c for c in script.calls if _name(c.func) in _ADAPTERS or _name(c.func) == "prepare"]
        for call in self._special:
            func = call.func
            name = _name(func)
            mentions = any(key_of(a) == k for a in (*call.args, *(kw.value for kw in call.keywords)))
            on_it = isinstance(func, ast.Attribute) and key_of(func.value) == k
            if name in _ADAPTERS and (mentions or on_it) and script.same_scope(call, at, k):
                if not (cast and (call.end_lineno or call.lineno) < at.lineno):
                    return True
            if name == "prepare" and mentions and self._sharded(func):
                return True
        return False

    def _setup_keeps(self, call: ast.Call) -> bool:
        """``fabric.setup_module(model)``, ``fabric.setup(model, opt)``, ``accelerator.prepare(model)``:
        the module wrapped, its parameters as they were, unless the Fabric is built with a DeepSpeed
        strategy or the Accelerator with FSDP/DeepSpeed (which keep fp32 master weights)."""
        func = call.func
        if not isinstance(func, ast.Attribute):
            return False
        if func.attr == "prepare":
            return self._accelerator(func.value) and not self._sharded(func)
        if func.attr not in ("setup_module", "setup"):
            return False
        built = [v for v in values(self.script, func.value) or [] if isinstance(v, ast.Call)]
        fabrics = [v for v in built if self.script.qualname(v.func) in _FABRICS]
        if fabrics:
            return not any("deepspeed" in ast.unparse(kw.value).lower() for v in fabrics for kw in v.keywords
                           if kw.arg in ("strategy", None))
        return not built and "fabric" in (key_of(func.value) or "").lower()

    def _accelerator(self, receiver: ast.AST) -> bool:
        """An Accelerate ``Accelerator``: built as one in the file, or a name that says so."""
        built = [v for v in values(self.script, receiver) or [] if isinstance(v, ast.Call)]
        if built:
            return all((self.script.qualname(v.func) or "").startswith("accelerate.") for v in built)
        return "accelerator" in (key_of(receiver) or "").lower()

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
        if isinstance(value, ast.Call) and self.script.qualname(value.func) in _WRAPPERS | _FSDP:
            if self.script.qualname(value.func) in _FSDP and (len(value.args) > 6 or any(
                    kw.arg in ("mixed_precision", None) for kw in value.keywords)):
                return False  # FSDP with a MixedPrecision policy: left to it, as an upcast
            return bool(value.args) and (key_of(value.args[0]) == k or self._keeps(k, value.args[0]))
        if isinstance(value, ast.Call) and self._setup_keeps(value):
            return any(key_of(a) == k or self._keeps(k, a) for a in value.args)
        if self._upcasts(value):
            return False  # back to fp32
        node = value
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr not in _KEEPS:
                return False
            node = node.func.value
        return key_of(node) == k

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
            if not opts or self._exempt(cast.key, cast.call, cast=True):
                continue
            before = [o for o in opts if o.lineno > cast.stmt.lineno and not self._rebinds(cast.key, cast.stmt, o)
                      and not self._upcast_between(cast.key, cast.stmt, o)]
            after = [o for o in opts if o.lineno < cast.stmt.lineno] if cast.in_place and self._trains_after(cast) else []
            if not before and not after:
                continue
            when = "" if cast.dtypes <= _SIXTEEN else f" when {cast.dtype_text}"
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
