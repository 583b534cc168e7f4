"""Which reductions ran on 16-bit inputs, and in which module: one forward (and loss) watched.

A reduction (a sum, a mean, a variance, a norm, a softmax, a loss) is where 16 bits hurt: it
adds many terms, and either accumulates them in 16 bits or rounds a result that cancellation has
already emptied. ``ReductionTrace`` is a ``TorchFunctionMode`` that sees every torch call inside
its ``with`` block (an op in a module's own ``forward`` body included) and records the reductions
whose floating inputs were bf16 or fp16, with the innermost module running at the time (forward
pre/post hooks keep a stack of module names).

It is measuring code, shared by tools: ``compare --explain`` reports these reductions as the
evidence for "a loss or a reduction computed in 16 bits". It records dtypes and sizes, never
values, and costs a dict lookup per torch call.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> with ReductionTrace(net) as trace, torch.autocast("cpu", dtype=torch.bfloat16):
...     _ = net(torch.randn(2, 4)).softmax(-1).mean()
>>> [(r.module, r.op, r.dtype) for r in trace.records]
[('(outside the model)', 'softmax', 'bf16'), ('(outside the model)', 'mean', 'bf16')]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Ops that add up (or normalise over) many terms. Matched on the callable's ``__name__``.
REDUCTIONS = frozenset(
    """sum nansum mean nanmean var std var_mean std_mean norm vector_norm matrix_norm cumsum cumprod prod
    logsumexp logcumsumexp softmax log_softmax layer_norm group_norm batch_norm instance_norm rms_norm
    cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div cosine_similarity""".split()
)
_SIXTEEN = {torch.float16: "f16", torch.bfloat16: "bf16"}
OUTSIDE = "(outside the model)"


@dataclasses.dataclass
class Reduction:
    """One reduction op seen on 16-bit inputs: where, which op, the dtype, how many elements went
    in (the largest input), and how many times it ran inside the watched block."""

    module: str
    op: str
    dtype: str
    numel: int
    calls: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _floating(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _floating(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _floating(item, out)


class _ModuleStack(TorchFunctionMode):
    """A ``TorchFunctionMode`` that knows which module of ``model`` is running (the innermost)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Any:
        for name, module in self.model.named_modules():
            label = name or "(the model)"
            self._handles.append(module.register_forward_pre_hook(lambda m, a, label=label: self._stack.append(label)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._pop(), always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _pop(self) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def where(self) -> str:
        return self._stack[-1] if self._stack else OUTSIDE


class ReductionTrace(_ModuleStack):
    """Record the reductions on 16-bit inputs run inside the ``with`` block (see the module doc).

    ``records``: one ``Reduction`` per (module, op, dtype), in the order first seen. The model's
    root module is named ``"(the model)"``; ops run outside any module (a loss) ``OUTSIDE``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._found: dict[tuple[str, str, str], Reduction] = {}

    @property
    def records(self) -> list[Reduction]:
        return list(self._found.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = (getattr(func, "__name__", "") or "").strip("_")
        if name in REDUCTIONS:
            tensors: list[torch.Tensor] = []
            _floating((args, kwargs), tensors)
            sixteen = [t for t in tensors if t.dtype in _SIXTEEN]
            if sixteen:
                where = self.where
                dtype = _SIXTEEN[sixteen[0].dtype]
                numel = max(t.numel() for t in sixteen)
                key = (where, name, dtype)
                found = self._found.get(key)
                if found is None:
                    self._found[key] = Reduction(where, name, dtype, numel)
                else:
                    found.calls += 1
                    found.numel = max(found.numel, numel)
        return func(*args, **kwargs)


class FirstNonFinite(_ModuleStack):
    """The first op inside the ``with`` block that returned a non-finite value from finite inputs:
    ``found`` is ``(module, op, output dtype, largest |input|)`` or None. One ``isfinite`` per op:
    for a short replay of one module, not for training.

    >>> lin = torch.nn.Linear(2, 2)
    >>> with FirstNonFinite(lin) as watch:
    ...     _ = (lin(torch.ones(1, 2)) * 1e30).to(torch.float16)
    >>> watch.found[1], watch.found[2]
    ('to', 'f16')
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.found: tuple[str, str, str, float] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None:
            outs: list[torch.Tensor] = []
            _floating(out, outs)
            if any(not bool(torch.isfinite(t).all()) for t in outs if t.numel()):
                ins: list[torch.Tensor] = []
                _floating((args, kwargs), ins)
                if all(bool(torch.isfinite(t).all()) for t in ins if t.numel()):
                    top = max((float(t.detach().abs().max()) for t in ins if t.numel()), default=0.0)
                    name = (getattr(func, "__name__", "") or "op").strip("_")
                    dtype = next((_SIXTEEN.get(t.dtype, str(t.dtype).removeprefix("torch.")) for t in outs), "-")
                    self.found = (self.where, name, dtype, top)
        return out
