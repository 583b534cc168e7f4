"""Watching a model run: which module and op made each tensor, and the range of every tensor.

Shared by the NaN guard and the activation-range probe. A ``Tracer`` attaches to a model:

- forward pre/post hooks on every submodule keep a stack of module calls, so any op can be named
  by the innermost module running it (the post hook is ``always_call`` so the stack survives
  exceptions);
- a ``TorchFunctionMode`` sees every torch call inside the forward (``q @ k.transpose(-2, -1)``
  in an attention module's body included) and records the range of its inputs and outputs;
- hooks on the autograd nodes those ops created record the gradients flowing through them in
  backward (a node hook sees the gradient that came in and the one going out, without wrapping
  tensors the way ``register_full_backward_hook`` does, so in-place ops keep working).

Ranges are ``torch.aminmax`` results left on the device; ``StatsBuffer.read`` fetches them all in
one transfer, so a guarded step costs one host sync per check instead of one per tensor. NaN
propagates through min and max and an infinity shows up as one of them, so one pass per tensor
gives both the range and the finiteness.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.diagnostics._ops import _force_inplace, _func_info, _scan, op_name
from mixprec.diagnostics._stats import StatsBuffer, TensorRange, _is_float, floating_tensors

__all__ = ["ModuleCall", "Record", "StatsBuffer", "TensorRange", "Tracer", "floating_tensors", "hook_count", "op_name"]

# Backward nodes that only move a gradient around (views, transposes, splits, clones): they cannot
# make a non-finite value from finite ones, and in a transformer they are over half of all nodes,
# each hook call costing tens of microseconds. They are walked through, not hooked.
_LAYOUT_NODES = frozenset(
    """ViewBackward UnsafeViewBackward TransposeBackward TBackward PermuteBackward CloneBackward
    SplitBackward SplitWithSizesBackward UnsqueezeBackward SqueezeBackward SelectBackward SliceBackward
    UnbindBackward AliasBackward AsStridedBackward ReshapeAliasBackward NarrowBackward DiagonalBackward
    DetachBackward""".split()
)

# Ops whose backward hands each input the incoming gradient unchanged (or negated) when no input
# is broadcast, promoted or scaled by ``alpha``: their nodes cannot make a non-finite gradient either,
# so inside a module they are walked through like layout nodes (a transformer's residual adds are a
# sixth of its hooked nodes). A broadcast add's node sums the gradient (it can overflow) and a
# promoting one casts it down (likewise): those stay hooked.
_ROUTE_OPS = frozenset("add add_ sub sub_ rsub neg neg_ negative".split())
_JOIN_OPS = frozenset("cat concat concatenate stack".split())  # backward: slices, when no input is promoted
# A tensor times a number of magnitude <= 1, or over one of >= 1: its backward scales the gradient
# down, which cannot overflow (GPT-2's GELU has three such). A larger factor can: hooked.
_SHRINK_OPS = {"mul": False, "mul_": False, "div": True, "div_": True}  # name -> divides?
_ROUTE_NODES = frozenset("""AddBackward0 AddBackward1 SubBackward0 SubBackward1 RsubBackward0 RsubBackward1 NegBackward0
    CatBackward0 StackBackward0 MulBackward0 MulBackward1 DivBackward0 DivBackward1""".split())  # Mul/Div: only when the op said so

_TORCH_DIR = os.path.dirname(torch.__file__)
_MIXPREC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TASKS_DIR = os.path.join(_MIXPREC_DIR, "tasks")  # the built-in task is user code for this purpose
# Keyed by id(code): hashing a code object hashes its bytecode and constants (0.3-0.7 us for a
# transformers forward, against 0.09 for an int), once per frame walked per op. The code object is
# kept in the entry, so its id cannot be reused by another while the entry exists.
_USER_CODE: dict[int, tuple[Any, bool]] = {}  # id(code) -> (code, outside torch and mixprec?)
_WHERE: dict[tuple[int, int], str] = {}  # (id(code), line) -> "file.py:LINE in function": formatted once
_MARK = "mixprec.diagnostics"  # prefix of our keys in autograd nodes' metadata
_TOKENS = itertools.count(1)

# Our own tensor calls in hooks must not go through the op mode: they would be recorded, and each
# pass through a Python mode costs microseconds (hooks run while the mode is live).
_quiet = torch._C.DisableTorchFunction

_ACCUMULATE, _LAYOUT, _HOOKED = 0, 1, 2
_NODE_CLASSES: dict[type, tuple[int, str, bool]] = {}  # node class -> (kind, name(), a routing class?);
# name() is per class: a custom Function's node class is its own


def _node_class(node: Any) -> tuple[int, str, bool]:
    """What ``adopt`` does with an autograd node of this class, its name and whether it is a routing class
    (computed once per class: a few dozen)."""
    cls = type(node)
    name = cls.__name__
    kind = _ACCUMULATE if name == "AccumulateGrad" else _LAYOUT if name.rstrip("0123456789") in _LAYOUT_NODES else _HOOKED
    c = _NODE_CLASSES[cls] = (kind, node.name(), name in _ROUTE_NODES)
    return c


@dataclasses.dataclass(eq=False)
class ModuleCall:
    """One call of one module (identity matters: the same module called twice is two calls)."""

    name: str
    type: str
    parent: "ModuleCall | None"
    serial: int

    def ancestors(self) -> Iterator["ModuleCall"]:
        c: ModuleCall | None = self
        while c is not None:
            yield c
            c = c.parent


class Record(NamedTuple):
    """One observation: an op (``op`` set), a module call (``op`` None) or a backward node (``node`` set).

    ``inputs``/``outputs`` index the ``StatsBuffer``; in backward, inputs are the gradients that
    came in (w.r.t. the op's outputs) and outputs those going out (w.r.t. its inputs).
    """

    phase: str
    call: ModuleCall | None
    op: str | None
    node: str | None
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    scalar_nan: bool
    scalar_inf: bool
    where: str | None


# Records are made by the hundred per step: tuple.__new__ skips the Python-level __new__ a NamedTuple
# class has (0.36 against 0.94 us a record on an AVX2 EPYC). Positional, in Record's field order.
_new = tuple.__new__


class _NodeInfo:
    """What the tracer knows of an autograd node; kept in the node's metadata (no reference back
    to the node, so no cycle keeps a graph alive)."""

    __slots__ = ("token", "call", "op", "node", "where", "consumed")

    def __init__(self, token: int, call: ModuleCall | None, op: str | None, node: str, where: str | None) -> None:
        self.token, self.call, self.op, self.node, self.where = token, call, op, node, where
        self.consumed = False


class _OpMode(TorchFunctionMode):
    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Runs for every torch call in a watched forward: keep the common paths short.
        if kwargs is None:
            kwargs = {}
        name, passthrough, inplace, flagged = _func_info(func)
        tr = self.tracer
        if tr.stats.lazy and (inplace or (kwargs and ("out" in kwargs or kwargs.get("inplace") is True))
                              or (flagged and args and args[-1] is True)):
            _force_inplace(tr.stats, args, kwargs)  # a value kept for later must be measured before it is overwritten
        if passthrough:
            return func(*args, **kwargs)
        call = tr.stack[-1] if tr.stack else None
        if call is None and not (tr.outside_modules and torch.is_grad_enabled()):
            return func(*args, **kwargs)
        ins, sn, si = _scan(args, kwargs)
        add = tr.stats.add
        in_idx = tuple([add(t) for t in ins])  # before the op: in-place ops overwrite them
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            outs = [out] if out.is_floating_point() else []
        else:
            outs = floating_tensors(out)
        if not outs:
            return out
        out_idx = tuple([add(t) for t in outs])
        where = tr.locate() if tr.locate_ops else None
        tr.records.append(_new(Record, ("forward", call, name, None, in_idx, out_idx, sn, si, where)))
        if tr.backward:
            route = (call is not None and len(outs) == 1 and (
                (name in _ROUTE_OPS and not kwargs and _same_layout(ins, outs[0]))
                or (name in _JOIN_OPS and (not kwargs or kwargs.keys() == {"dim"})
                    and all(t.dtype == outs[0].dtype for t in ins))
                or (name in _SHRINK_OPS and not kwargs and _shrinks(args, ins, outs[0], _SHRINK_OPS[name]))))
            for t in outs:
                fn = t.grad_fn
                if fn is not None:
                    tr.adopt(fn, call, name, where, route)
        return out


def _shrinks(args: tuple, ins: list[torch.Tensor], out: torch.Tensor, divides: bool) -> bool:
    """``t * c`` (either order) with ``|c| <= 1``, or ``t / c`` with ``|c| >= 1``: one floating tensor
    of the output's shape and dtype and one Python number, so the gradient only shrinks."""
    if len(args) != 2 or len(ins) != 1 or not _same_layout(ins, out):
        return False
    a, b = args
    c = b if a is ins[0] else a if (b is ins[0] and not divides) else None
    if type(c) not in (float, int):
        return False
    return abs(c) >= 1 if divides else abs(c) <= 1  # False for NaN


def _same_layout(ins: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Every floating input has the output's shape and dtype (no broadcast, no promotion)."""
    shape, dtype = out.shape, out.dtype
    return all(t.shape == shape and t.dtype == dtype for t in ins)


class Tracer:
    """Hooks a model so every op and module call in its forward (and backward) is recorded.

    Args:
        model: the module to watch (all its submodules are hooked).
        ops: watch individual torch calls with a ``TorchFunctionMode`` (else module outputs only).
        backward: hook the autograd nodes created in the forward.
        outside_modules: also record ops run outside the model while the mode is active (a loss
            computed in a ``with`` block), as long as grad mode is on (so optimizer steps are not).
        locate_ops: note the source line of each op (file:line in function).
        finite_only: measure the largest finite magnitude instead of the range (ignores the -inf of a mask).
        lazy: measure small tensors at the check, in one batch, not when they are made (``StatsBuffer``).
        on_forward_end / on_backward_start / on_backward_end: callbacks (the guard's checks).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ops: bool = True,
        backward: bool = True,
        outside_modules: bool = False,
        locate_ops: bool = True,
        finite_only: bool = False,
        lazy: bool = False,
        on_forward_end: Callable[[], None] | None = None,
        on_backward_start: Callable[[], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.ops = ops
        self.backward = backward
        self.outside_modules = outside_modules
        self.locate_ops = locate_ops
        self.on_forward_end = on_forward_end
        self.on_backward_start = on_backward_start
        self.on_backward_end = on_backward_end
        self.stats = StatsBuffer(finite_only, lazy=lazy)
        self.records: list[Record] = []
        self.stack: list[ModuleCall] = []
        self.forward_calls = 0  # completed calls of the root module
        self._pending_inputs: list[tuple[int | None, ...]] = []
        self._handles: list[Any] = []
        self._node_handles: list[Any] = []
        self._routes: list[tuple[Any, _NodeInfo]] = []  # router nodes not hooked (see adopt), this forward
        self._token = 0  # this attachment; its key marks the nodes it hooked (see adopt)
        self._key = ""
        self._mode: _OpMode | None = None
        self._scope_depth = 0
        self._in_backward = False
        self._serial = 0
        self._names: dict[int, tuple[str, str]] = {}

    # ------------------------------------------------------------------ attach / detach

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> "Tracer":
        if self.attached:
            return self
        self._token = next(_TOKENS)
        self._key = f"{_MARK}.{self._token}"  # one key per attachment: two tracers never share marks
        for name, m in self.model.named_modules():
            self._names[id(m)] = (name, type(m).__name__)
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for h in self._node_handles:
            h.remove()
        self._node_handles = []
        self._routes = []
        self._token = 0  # hooks left on older graphs (handles already dropped) now do nothing
        if self._mode is not None and self._scope_depth == 0:
            self._exit_mode()

    # ------------------------------------------------------------------ op scope

    def _enter_mode(self) -> None:
        if self.ops and self._mode is None:
            self._mode = _OpMode(self)
            self._mode.__enter__()

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def enter_scope(self) -> None:
        """Watch ops from now on, inside and outside the model (the ``with nan_guard(...)`` block)."""
        self._scope_depth += 1
        self._enter_mode()

    def exit_scope(self) -> None:
        self._scope_depth -= 1
        if self._scope_depth == 0:
            self._exit_mode()

    # ------------------------------------------------------------------ module hooks

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        name, typ = self._names.get(id(module), (type(module).__name__, type(module).__name__))
        root = not self.stack
        if root and module is self.model:
            # Earlier graphs keep their hooks (a backward through two forwards is watched) but we
            # drop the handles, so a long run does not pile them up; detach disarms those hooks.
            self._node_handles = []
            self._routes = []
            self._enter_mode()
        self._serial += 1
        call = ModuleCall(name, typ, self.stack[-1] if self.stack else None, self._serial)
        with _quiet():
            self._pending_inputs.append(tuple(self.stats.add(t) for t in floating_tensors((args, kwargs))))
        self.stack.append(call)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.stack:
            return
        call = self.stack.pop()
        in_idx = self._pending_inputs.pop()
        with _quiet():
            outs = floating_tensors(output)
            out_idx = tuple(self.stats.add(t) for t in outs)
            if outs:
                self.records.append(_new(Record, ("forward", call, None, None, in_idx, out_idx, False, False, None)))
            if self.backward:
                for t in outs:
                    if t.grad_fn is not None:
                        self.adopt(t.grad_fn, call, None, None)
        if self.stack:
            return
        self._hook_unconsumed_routes()  # an outermost call ended (the model's, or a submodule's called alone)
        if module is self.model:
            self.forward_calls += 1
            if self._scope_depth == 0:
                self._exit_mode()
            if output is not None and self.on_forward_end is not None:
                self.on_forward_end()

    # ------------------------------------------------------------------ backward

    def adopt(self, node: Any, call: ModuleCall | None, op: str | None, where: str | None, route: bool = False) -> None:
        """Hook ``node`` and the nodes behind it not seen yet: those were made by this op (or module).

        ``route``: the op hands its gradient on unchanged or smaller (the op mode decides: a
        same-layout add/sub/neg, a one-dtype cat/stack, a scaling that shrinks); its own node, when
        of a routing class (``_ROUTE_NODES``), is marked and walked through, not hooked.
        The gradient reaching it is then measured where it leaves the watched node that sent it;
        one that no watched node sends (the node makes the model's output) is hooked when the
        forward ends (``_hook_unconsumed_routes``)."""
        key = self._key
        classes = _NODE_CLASSES
        todo = [node]
        while todo:
            n = todo.pop()
            if n is None:
                continue
            c = classes.get(type(n))
            if c is None:
                c = _node_class(n)
            kind = c[0]
            if kind == _ACCUMULATE:
                continue  # a leaf's .grad: the gradient reaching it was already seen leaving its consumer
            # The mark lives on the C++ node (its metadata dict), so it cannot be confused with
            # another node the way a Python id of a short-lived wrapper could, and holds nothing alive.
            meta = n.metadata
            mark = meta.get(key)
            if mark is not None:
                if n is not node:  # reached by an edge: a watched op uses its output, so its gradient comes from us
                    mark.consumed = True
                continue
            info = meta[key] = _NodeInfo(self._token, call, op, c[1], where)
            for f, _ in n.next_functions:  # a loop, not a generator: this runs for every new node
                todo.append(f)
            if kind == _HOOKED:
                if route and c[2] and n is node:
                    self._routes.append((n, info))
                else:
                    self._node_handles.append(n.register_hook(functools.partial(self._on_node, info)))

    def _hook_unconsumed_routes(self) -> None:
        """Hook the router nodes of this forward that no watched op consumed: their incoming
        gradient (the model's output's) would be measured by nobody."""
        for n, info in self._routes:
            if not info.consumed:
                self._node_handles.append(n.register_hook(functools.partial(self._on_node, info)))
        self._routes = []

    def _on_node(self, info: "_NodeInfo", grad_inputs: tuple, grad_outputs: tuple) -> None:
        if info.token != self._token:
            return  # hooked by an earlier attachment: disarmed
        if not self._in_backward:
            self._in_backward = True
            if self.on_backward_start is not None:
                self.on_backward_start()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        with _quiet():  # an op mode may be live in backward: keep our own ops out of it
            gin, gout = self._measure_grads(info, grad_inputs, grad_outputs)
        if gout:
            self.records.append(_new(Record, ("backward", info.call, info.op, info.node, gin, gout, False, False, info.where)))

    def _measure_grads(self, info: "_NodeInfo", grad_inputs: tuple, grad_outputs: tuple) -> tuple[tuple, tuple]:
        add = self.stats.add
        # The gradient coming into a node that watched ops consume is what their nodes sent out,
        # already measured (or their sum): measuring it again would double the cost of backward.
        # Only gradients arriving from outside (the loss) are measured on the way in. (A sum of
        # finite gradients that overflows then blames this node: it is the node whose output
        # gradient went bad.)
        gin = () if info.consumed else tuple([add(g) for g in grad_outputs if _is_float(g)])
        return gin, tuple([add(g) for g in grad_inputs if _is_float(g)])

    def _end_backward(self) -> None:
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ------------------------------------------------------------------ reading

    def take(self) -> tuple[list[Record], list[TensorRange]]:
        """The records so far and the ranges they index (one host sync); both start afresh."""
        records, self.records = self.records, []
        with _quiet():
            return records, self.stats.read()

    @staticmethod
    def locate() -> str | None:
        """``file.py:LINE in function`` of the innermost caller outside torch and mixprec."""
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            hit = _USER_CODE.get(id(code))  # an entry keeps its code alive: the id is this code's
            if hit is None:
                fn = code.co_filename
                hit = (code, not fn.startswith(_TORCH_DIR) and (not fn.startswith(_MIXPREC_DIR) or fn.startswith(_TASKS_DIR)))
                if len(_USER_CODE) < 65536:
                    _USER_CODE[id(code)] = hit
            if hit[1]:
                key = (id(code), f.f_lineno)
                text = _WHERE.get(key)
                if text is None:
                    text = f"{os.path.basename(code.co_filename)}:{key[1]} in {code.co_name}"
                    if len(_WHERE) < 65536 and key[0] in _USER_CODE:  # only for a code kept alive above
                        _WHERE[key] = text
                return text
            f = f.f_back
        return None


def hook_count(model: nn.Module) -> int:
    """Hooks of every kind registered on ``model`` and its submodules (0 means untouched)."""
    total = 0
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            total += len(getattr(m, attr, {}) or {})
    return total
