"""Which dtypes an expression may be, and which autocast a ``with`` enters, from the text alone.

Real scripts choose the dtype at run time: ``amp_dtype = torch.float16`` then
``if args.bf16: amp_dtype = torch.bfloat16``, ``torch.bfloat16 if use_bf16 else torch.float16``,
``{"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]``. ``dtypes`` answers with the set
of dtypes the expression may be ({"fp16", "bf16"} for those), or None when it cannot tell
(``getattr(torch, name)``, a parameter). A rule that needs one dtype asks for a set of one.

The autocast entered by ``with X:`` is found for ``torch.autocast(...)`` and its deprecated
spellings, a name bound to one (``ctx = torch.autocast(...)``), a conditional expression
(``nullcontext() if cpu else torch.autocast(...)``), a factory called in the ``with``
(``amp_autocast = partial(torch.autocast, dtype=amp_dtype)`` or ``= torch.cuda.amp.autocast``,
with ``suppress``/``nullcontext`` in the other branch: an autocast that may be off), and
Accelerate's ``accelerator.autocast()`` (its dtype read from ``Accelerator(mixed_precision=...)``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from mixprec.lint.names import AUTOCASTS, DTYPES, argument, key_of

# What torch.autocast uses when no dtype is given (torch.get_autocast_dtype's defaults).
_DEFAULT_DTYPE = {"cuda": "fp16", "cpu": "bf16"}
_NO_OP = frozenset({"contextlib.nullcontext", "contextlib.suppress", "contextlib.ExitStack"})
_ACCELERATORS = frozenset({"accelerate.Accelerator", "accelerate.accelerator.Accelerator"})
_PRECISIONS = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}  # Accelerate's mixed_precision -> autocast dtype
_MAX_DEPTH = 4


@dataclass(frozen=True)
class Autocast:
    """One autocast a region enters. ``dtype``: the dtype when exactly one is possible, else
    None; ``dtypes``: every dtype it may run (None: unknown); ``enabled``: True, False, or None
    (decided at run time); ``device``: "cuda", "cpu"... or None; ``switch``: the run-time
    expression that turns it on (``enabled=flag``, the test of ``x if flag else nullcontext()``)."""

    node: ast.AST
    dtype: str | None
    enabled: bool | None
    device: str | None = None
    dtypes: frozenset | None = field(default=None, compare=False)
    switch: ast.expr | None = field(default=None, compare=False, hash=False)
    dtype_arg: ast.expr | None = field(default=None, compare=False, hash=False)  # the dtype as written


def values(script, node: ast.AST) -> list[ast.expr] | None:
    """The values a name may hold where ``node`` reads it: its assignments in the same function
    when it has any there, else those at module level, else every one in the file."""
    k = key_of(node)
    found = script.assigns.get(k, []) if k else []
    if not found:
        return None
    if k.startswith("self."):
        return found
    owner = script.owner(node)
    here = [v for v in found if script.owner(v) is owner]
    if here:
        return here
    top = [v for v in found if script.owner(v) is None]
    return top or found


def dtypes(script, node: ast.AST | None, depth: int = 0) -> frozenset | None:
    """The dtypes ("fp16", "bf16", "fp32", "fp64") ``node`` may be, or None when unknown."""
    if node is None or depth > _MAX_DEPTH:
        return None
    found = DTYPES.get(script.qualname(node) or "")
    if found is not None:
        return frozenset({found})
    if isinstance(node, ast.IfExp):
        arms = [dtypes(script, node.body, depth + 1), dtypes(script, node.orelse, depth + 1)]
        return None if None in arms else arms[0] | arms[1]
    if isinstance(node, ast.Subscript):  # {"fp16": torch.float16, ...}[args.dtype]
        table = node.value
        if isinstance(table, (ast.Name, ast.Attribute)):
            bound = values(script, table)
            table = bound[0] if bound and len(bound) == 1 else table
        if isinstance(table, ast.Dict) and table.values:
            arms = [dtypes(script, v, depth + 1) for v in table.values]
            return None if None in arms else frozenset().union(*arms)
        return None
    if isinstance(node, (ast.Name, ast.Attribute)) and script.qualname(node) is None:
        bound = values(script, node)
        if not bound:
            return None
        arms = [dtypes(script, v, depth + 1) for v in bound]
        return None if None in arms else frozenset().union(*arms)
    return None


def one_dtype(script, node: ast.AST | None) -> str | None:
    found = dtypes(script, node)
    return next(iter(found)) if found is not None and len(found) == 1 else None


def autocast(script, node: ast.AST | None, depth: int = 0) -> Autocast | None:
    """The autocast a ``with`` item or decorator enters; None when it is not one."""
    if node is None or depth > _MAX_DEPTH:
        return None
    if isinstance(node, ast.IfExp):
        arms = [autocast(script, node.body, depth + 1), autocast(script, node.orelse, depth + 1)]
        on = [a for a in arms if a is not None]
        if not on:
            return None
        if len(on) == 1:  # ``torch.autocast(...) if amp else nullcontext()``: on when the test says so
            if not _no_op(script, node.orelse if arms[0] else node.body):
                return None
            return _combine(node, [on[0], None], node.test)
        return _combine(node, on, on[0].switch)
    if isinstance(node, (ast.Name, ast.Attribute)):
        bound = values(script, node)
        if not bound:
            return None
        arms = [None if _no_op_value(script, v) else autocast(script, v, depth + 1) for v in bound]
        if all(a is None for a in arms) or any(a is None and not _no_op_value(script, v) for a, v in zip(arms, bound)):
            return None
        return _combine(node, arms, None)
    if not isinstance(node, ast.Call):
        return None
    spec = AUTOCASTS.get(script.qualname(node.func) or "")
    if spec is not None:
        return _from_call(script, node, spec, node.args, node.keywords)
    if isinstance(node.func, ast.Attribute) and node.func.attr == "autocast" and not node.args:
        accelerator = _accelerator(script, node.func.value)
        if accelerator is not None:
            return accelerator
    return _factory(script, node, depth)


def _from_call(script, node, spec, args, keywords) -> Autocast:
    params, device = spec
    call = ast.Call(func=node, args=list(args), keywords=list(keywords))
    if device is None:
        device = script.constant(argument(call, 0, "device_type"))
    device = device if isinstance(device, str) else None
    dtype_arg = argument(call, params.index("dtype"), "dtype")
    if dtype_arg is None or (isinstance(dtype_arg, ast.Constant) and dtype_arg.value is None):
        found = frozenset({_DEFAULT_DTYPE[device]}) if device in _DEFAULT_DTYPE else None
    else:
        found = dtypes(script, dtype_arg)
    enabled_arg = argument(call, params.index("enabled"), "enabled")
    enabled = script.constant(enabled_arg, True)
    enabled = enabled if isinstance(enabled, bool) else None
    single = next(iter(found)) if found is not None and len(found) == 1 else None
    return Autocast(node, single, enabled, device, found, enabled_arg if enabled is None else None, dtype_arg)


def _factory(script, call: ast.Call, depth: int) -> Autocast | None:
    """``amp_autocast()`` where ``amp_autocast`` is an autocast class, a ``partial`` of one, or
    (in some branches) a no-op context like ``suppress``."""
    func = call.func
    if not isinstance(func, (ast.Name, ast.Attribute)) or script.qualname(func) is not None:
        return None
    return _called(script, values(script, func), call)


def _called(script, bound: list[ast.expr] | None, call: ast.Call) -> Autocast | None:
    """The autocast ``call`` enters when its callee may be any of ``bound``."""
    if not bound:
        return None
    arms: list[Autocast | None] = []
    for value in bound:
        if _no_op(script, value):
            arms.append(None)
            continue
        spec = AUTOCASTS.get(script.qualname(value) or "")
        if spec is not None:
            arms.append(_from_call(script, call, spec, call.args, call.keywords))
            continue
        if isinstance(value, ast.Call) and script.qualname(value.func) == "functools.partial" and value.args:
            spec = AUTOCASTS.get(script.qualname(value.args[0]) or "")
            if spec is not None:
                arms.append(_from_call(script, call, spec, [*value.args[1:], *call.args], [*value.keywords, *call.keywords]))
                continue
        return None  # something else the name may be: not known to be an autocast
    if all(a is None for a in arms):
        return None
    return _combine(call, arms, None)


def autocast_for_key(script, key: str, item: ast.expr) -> Autocast | None:
    """The autocast ``item`` (``ctx`` or ``factory()`` in a ``with``) enters, where its name is
    ``key`` of ``script`` (a parameter's argument, resolved in the caller's file)."""
    bound = script.assigns.get(key)
    if not bound:
        return None
    if isinstance(item, ast.Call):
        return _called(script, bound, item)
    arms = [None if _no_op_value(script, v) else autocast(script, v, 1) for v in bound]
    if all(a is None for a in arms) or any(a is None and not _no_op_value(script, v) for a, v in zip(arms, bound)):
        return None
    return _combine(item, arms, None)


def _accelerator(script, receiver: ast.AST) -> Autocast | None:
    bound = values(script, receiver) if isinstance(receiver, (ast.Name, ast.Attribute)) else None
    built = [v for v in bound or [] if isinstance(v, ast.Call) and script.qualname(v.func) in _ACCELERATORS]
    if not built:
        k = key_of(receiver) or ""
        return Autocast(receiver, None, None) if "accelerator" in k.lower() else None
    precisions = {script.constant(argument(v, 99, "mixed_precision"), "no") for v in built}
    if precisions == {"no"}:
        return Autocast(receiver, None, False)
    found = {_PRECISIONS.get(p) for p in precisions if p != "no"}
    if None in found or len(precisions) != 1:
        return Autocast(receiver, None, None)
    dtype = found.pop()
    return Autocast(receiver, dtype, True, None, frozenset({dtype}))


_NO_SCALER_PLUGINS = frozenset({"deepspeed_plugin", "megatron_lm_plugin", "fsdp_plugin", "parallelism_config"})


def is_accelerator(script, bound: list[ast.expr] | None) -> bool:
    """Whether a name that may hold any of ``bound`` is an Accelerate ``Accelerator``."""
    return bool(bound) and all(isinstance(v, ast.Call) and script.qualname(v.func) in _ACCELERATORS for v in bound)


def accelerator_precisions(script, bound: list[ast.expr] | None) -> frozenset[str] | None:
    """The ``mixed_precision`` values an Accelerator bound to one of ``bound`` may be built
    with, when each construction is in sight and keeps Accelerate's own GradScaler (fp16 makes
    one, except on the CPU and under DeepSpeed or Megatron). None when anything is out of sight
    or may change that: a value that is not in the file (a flag, ``accelerate config``, the
    environment), ``**kwargs``, a plugin (DeepSpeed, Megatron and FSDP scale and clip their own
    way), ``cpu=`` other than False, ``kwargs_handlers`` that set ``enabled``."""
    built = [v for v in bound or [] if isinstance(v, ast.Call) and script.qualname(v.func) in _ACCELERATORS]
    if not built or len(built) != len(bound):
        return None
    found: set[str] = set()
    for call in built:
        given = {kw.arg: kw.value for kw in call.keywords}
        if call.args or None in given or _NO_SCALER_PLUGINS & given.keys():
            return None
        if script.constant(given.get("cpu"), False) is not False:
            return None
        handlers = given.get("kwargs_handlers")
        if handlers is not None and any(isinstance(n, ast.keyword) and n.arg in ("enabled", None) for n in ast.walk(handlers)):
            return None
        strings = _strings(script, given.get("mixed_precision"), 0)
        if strings is None:
            return None
        found |= strings
    return frozenset(found)


def _strings(script, node: ast.AST | None, depth: int) -> frozenset[str] | None:
    """The string literals ``node`` may be (a literal, a conditional of literals, a name
    assigned only literals); None for anything else."""
    if node is None or depth > _MAX_DEPTH:
        return None
    if isinstance(node, ast.Constant):
        return frozenset({node.value}) if isinstance(node.value, str) else None
    if isinstance(node, ast.IfExp):
        arms = [_strings(script, node.body, depth + 1), _strings(script, node.orelse, depth + 1)]
        return None if None in arms else arms[0] | arms[1]
    if isinstance(node, (ast.Name, ast.Attribute)):
        bound = values(script, node)
        arms = [_strings(script, v, depth + 1) for v in bound or []]
        return None if not arms or None in arms else frozenset().union(*arms)
    return None


def _combine(node, arms: list[Autocast | None], switch) -> Autocast:
    """One autocast for several possible ones (None: a branch with no autocast)."""
    on = [a for a in arms if a is not None]
    found = None if any(a.dtypes is None for a in on) else frozenset().union(*(a.dtypes for a in on))
    enabled = {a.enabled for a in on}
    state = enabled.pop() if len(enabled) == 1 and None not in arms else None
    if state is None and enabled == {False}:
        state = False
    devices = {a.device for a in on}
    single = next(iter(found)) if found is not None and len(found) == 1 else None
    switches = [a.switch for a in on if a.switch is not None]
    written = [a.dtype_arg for a in on if a.dtype_arg is not None]
    return Autocast(node, single, state, devices.pop() if len(devices) == 1 else None, found,
                    switch if switch is not None else (switches[0] if switches else None),
                    written[0] if written else None)


def _no_op(script, node: ast.AST) -> bool:
    """``nullcontext()`` / ``suppress()`` (called), or None."""
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    target = node.func if isinstance(node, ast.Call) else node
    return script.qualname(target) in _NO_OP


def _no_op_value(script, node: ast.AST) -> bool:
    """A value that makes ``with x:`` / ``with x():`` enter no autocast."""
    return _no_op(script, node)
