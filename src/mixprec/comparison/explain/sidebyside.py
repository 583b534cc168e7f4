"""The fp32 model and the recipe's model, side by side: what each module received, handed on and
sent back, and what a module does alone on fp32's input.

- ``Recorder`` hooks every module of one model and, while ``active``, records each call: the
  floating tensors it received and returned (detached copies), the gradients that came back to its
  outputs (tensor hooks), and for the fp32 model the call's arguments and random state, so that
  the call can be replayed.
- ``replay`` runs one recorded call again, on one module of each model, from fp32's input (cast
  to the dtypes the recipe's module received) and fp32's output gradient: the error of the recipe
  module's output and gradients then is the error *that module adds*, not what it received.
- ``rel_error`` is the one error measure: ``||a - b|| / ||b||`` in float64 over every tensor of a
  call, inf when ``a`` holds a non-finite value that ``b`` does not.

Suffixes: ``_32`` the fp32 model's, ``_r`` the recipe's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn


# ---------------------------------------------------------------------------- nests of tensors


def floats(obj: Any) -> list[torch.Tensor]:
    """The floating tensors in a nest (lists, tuples, dicts and ModelOutput-like mappings), in order."""
    out: list[torch.Tensor] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                out.append(o)
        elif isinstance(o, (list, tuple)):
            for item in o:
                walk(item)
        elif isinstance(o, dict):
            for item in o.values():
                walk(item)

    walk(obj)
    return out


def rebuild(obj: Any, make: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """A copy of a nest whose floating tensors are ``make(tensor, index)`` (index as in ``floats``);
    other tensors are detached copies and everything else is kept as it is."""
    counter = [0]

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                i = counter[0]
                counter[0] += 1
                return make(o, i)
            return o.detach().clone()
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # a namedtuple
            return type(o)(*(walk(v) for v in o))
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        if isinstance(o, dict):
            items = {k: walk(v) for k, v in o.items()}
            try:
                return type(o)(items)
            except Exception:  # a mapping class that cannot be built from a dict
                return items
        return o

    return walk(obj)


def rel_error(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all the pairs, in float64; inf when ``a`` is non-finite where ``b``
    is finite (the recipe made it), NaN when shapes differ or ``b`` is empty."""
    if len(a) != len(b) or not b:
        return float("nan")
    num = den = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("nan")
        x64, y64 = x.detach().double(), y.detach().double()
        bad_x = ~torch.isfinite(x64)
        if bool(bad_x.any()):
            if bool((bad_x & torch.isfinite(y64)).any()):
                return float("inf")
            keep = torch.isfinite(y64)
            x64, y64 = x64[keep], y64[keep]
        num += float((x64 - y64).pow(2).sum())
        den += float(y64.pow(2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def flushed(a_r: Sequence[torch.Tensor], b_32: Sequence[torch.Tensor], scale: float = 1.0) -> tuple[int, int]:
    """(entries zero in ``a_r`` but not in ``b_32``, entries non-zero in ``b_32``): gradients the
    recipe flushed to zero. ``a_r`` may be scaled; only zeros count, so the scale does not matter."""
    zeroed = nonzero = 0
    for x, y in zip(a_r, b_32):
        if x.shape != y.shape:
            continue
        nz = y.detach() != 0
        nonzero += int(nz.sum())
        zeroed += int((nz & (x.detach() == 0)).sum())
    return zeroed, nonzero


def nonfinite(ts: Sequence[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t.detach()).all()) for t in ts)


# ---------------------------------------------------------------------------- recording calls


@dataclasses.dataclass(eq=False)
class Call:
    """One call of one module, as recorded (all tensors detached copies)."""

    name: str
    index: int  # the module's n-th call in this forward
    parent: str | None  # the module running when this one was called (None for the model itself)
    inputs: list[torch.Tensor]
    in_dtypes: list[torch.dtype]  # what the module received, before any island's cast
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output index -> gradient
    args: Any = None  # (args, kwargs) as received: the fp32 model's calls, for replay
    needs_grad: list[bool] = dataclasses.field(default_factory=list)  # per floating input
    rng: Any = None


class Recorder:
    """Hooks on every module of ``model``; records calls while ``active`` (see the module doc).

    ``keep_args``: keep each call's arguments and random state (the fp32 model's, for replay).
    The pre-hook runs before any other (``prepend``) so it sees what the module received before an
    island cast it; the post-hook runs after the others, so it sees what the module handed on.
    """

    def __init__(self, model: nn.Module, keep_args: bool) -> None:
        self.model, self.keep_args = model, keep_args
        self.active = False
        self.calls: list[Call] = []
        self.counts: dict[str, int] = {}
        self._open: list[Call] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(
                self._pre(name), with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        self.calls, self.counts, self._open = [], {}, []

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.active:
                return
            received = floats((args, kwargs))
            index = self.counts.get(name, 0)
            self.counts[name] = index + 1
            call = Call(name, index, self._open[-1].name if self._open else None,
                        inputs=[t.detach().clone() for t in received], in_dtypes=[t.dtype for t in received],
                        needs_grad=[t.requires_grad for t in received])
            if self.keep_args:
                call.args = rebuild((args, kwargs), lambda t, i: t.detach().clone())
                call.rng = _rng_state()
            self._open.append(call)
            self.calls.append(call)
        return hook

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.active or not self._open:
            return
        call = self._open.pop()
        outs = floats(output)
        call.outputs = [t.detach().clone() for t in outs]
        for i, t in enumerate(outs):
            if t.requires_grad:
                t.register_hook(_keep_grad(call, i))

    def by_key(self) -> dict[tuple[str, int], Call]:
        return {(c.name, c.index): c for c in self.calls}


def _keep_grad(call: Call, i: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        prev = call.grads.get(i)  # an output used twice gets its gradient in parts
        call.grads[i] = grad.detach().clone() if prev is None else prev + grad.detach()
    return hook


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------- replay


@dataclasses.dataclass
class Replay:
    """One module run alone on fp32's input: the recipe's error over fp32's, for that call."""

    added: float  # relative error of the output
    grad_added: float  # relative error of the gradients its backward sent to its inputs and parameters
    made_nonfinite: bool  # non-finite output from fp32's finite input
    unchanged: bool  # bitwise fp32's: an island cannot change what this module computes
    received_overflow: bool = False  # fp32's input does not fit the dtype it received: nothing measured
    nonfinite_op: str | None = None  # when it made a non-finite value: the first op that did, in words


def _own_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _grads(outs: list[torch.Tensor], grad_outs: dict[int, torch.Tensor], ins: list[torch.Tensor],
           params: list[nn.Parameter], scale: float) -> list[torch.Tensor | None]:
    """The gradients of ``ins`` (those that need one) and ``params`` given ``grad_outs`` times
    ``scale`` (cast to each output's dtype, as the recipe's backward would receive them), unscaled."""
    pairs = [(o, grad_outs[i]) for i, o in enumerate(outs) if i in grad_outs and o.requires_grad]
    targets = [t for t in ins if t.requires_grad] + params
    if not pairs or not targets:
        return []
    g = [(go * scale).to(o.dtype) for o, go in pairs]
    got = torch.autograd.grad([o for o, _ in pairs], targets, grad_outputs=g, allow_unused=True)
    return [None if x is None else x.detach().double() / scale for x in got]


def _buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Swap every buffer for a copy, returning (owner, name, original): a replayed forward must not move
    BatchNorm's running statistics, and the originals are put back untouched by ``_restore``. (Writing old
    values back with ``copy_`` bumped the version of buffers the training step's graph had saved, BERT's
    ``position_ids``, and its backward failed: found by a probe of ``--explain`` on Hugging Face BERT.)"""
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    copies: dict[int, torch.Tensor] = {}  # a buffer two modules share stays shared
    with torch.no_grad():
        for owner in module.modules():
            for name, b in list(owner._buffers.items()):
                if b is None:
                    continue
                copy = copies.get(id(b))
                if copy is None:
                    copy = copies[id(b)] = b.detach().clone()
                saved.append((owner, name, b))
                owner._buffers[name] = copy
    return saved


def _restore(saved: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for owner, name, original in saved:
        owner._buffers[name] = original


@contextlib.contextmanager
def _same_randomness(state: Any) -> Iterator[None]:
    """Run with the random state a recorded call started from (dropout draws the same mask), and
    leave the global generators as they were."""
    devices = [torch.cuda.current_device()] if state is not None and state[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        if state is not None:
            _set_rng(state)
        yield


def _matched_params(m32: nn.Module, m_r: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    r = dict(_own_params(m_r))
    pairs = [(p, r[n]) for n, p in _own_params(m32) if n in r]
    return [a for a, _ in pairs], [b for _, b in pairs]


def replay(call_32: Call, dtypes_r: Sequence[torch.dtype], m32: nn.Module, m_r: nn.Module,
           autocast: Callable[[], Any], scale: float) -> Replay:
    """Run ``call_32`` again on ``m32`` and on ``m_r`` (under ``autocast``), both from fp32's input
    (cast to ``dtypes_r``, what the recipe's module received) and fp32's output gradient (times
    the loss ``scale`` for the recipe, divided out after)."""
    p32, p_r = _matched_params(m32, m_r)
    saved = _buffers(m32) + _buffers(m_r)
    args = call_32.args

    def fresh(dtypes: Sequence[torch.dtype]) -> Any:
        return rebuild(args, lambda t, i: t.detach().clone().to(dtypes[i]).requires_grad_(call_32.needs_grad[i]))

    try:
        a32, k32 = fresh(call_32.in_dtypes)
        with _same_randomness(call_32.rng):
            outs32 = floats(m32(*a32, **k32))
        g32 = _grads(outs32, call_32.grads, floats((a32, k32)), p32, 1.0)
        a_r, k_r = fresh(dtypes_r)
        if nonfinite(floats((a_r, k_r))) and not nonfinite(floats((a32, k32))):
            # fp32's input does not fit the dtype this module received: the overflow happened where
            # that dtype was made (the module before), not here; nothing to measure for this one
            return Replay(float("nan"), float("nan"), False, False, received_overflow=True)
        with _same_randomness(call_32.rng), autocast():
            outs_r = floats(m_r(*a_r, **k_r))
        g_r = _grads(outs_r, call_32.grads, floats((a_r, k_r)), p_r, scale)
    finally:
        _restore(saved)
    pairs = [(x, y) for x, y in zip(g_r, g32) if x is not None and y is not None]
    grad_added = rel_error([x for x, _ in pairs], [y for _, y in pairs]) if pairs else float("nan")
    made = nonfinite(outs_r) and not nonfinite(outs32)
    op = _first_nonfinite_op(call_32, dtypes_r, fresh, m_r, autocast) if made else None
    same = (len(outs_r) == len(outs32) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(outs_r, outs32))
            and all(torch.equal(x, y) for x, y in pairs))
    return Replay(rel_error(outs_r, outs32), grad_added, made, same, nonfinite_op=op)


def _first_nonfinite_op(call_32: Call, dtypes_r: Sequence[torch.dtype], fresh: Callable[..., Any], m_r: nn.Module,
                        autocast: Callable[[], Any]) -> str | None:
    """Run the recipe's module once more, watching every op, and name the first that made a
    non-finite value from finite inputs (``instruments.reductions.FirstNonFinite``)."""
    from mixprec.instruments.reductions import FirstNonFinite

    saved = _buffers(m_r)
    try:
        a_r, k_r = fresh(dtypes_r)
        with torch.no_grad(), _same_randomness(call_32.rng), autocast(), FirstNonFinite(m_r) as watch:
            m_r(*a_r, **k_r)
    finally:
        _restore(saved)
    if watch.found is None:
        return None
    where, op, dtype, top = watch.found
    # the watch names modules relative to m_r: "(the model)" is this module's own code
    inside = "" if where == "(the model)" else f" in {call_32.name + '.' + where if call_32.name else where}"
    return f"{op}{inside} -> {dtype} (inputs up to {top:.3g})"
