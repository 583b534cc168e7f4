"""What a torch call is, as the tracer's op mode sees it: its short name, whether it can make a
non-finite value at all, whether it writes into an argument in place, and its tensor arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.diagnostics._stats import StatsBuffer, _scalar_flags

# Ops that cannot create a non-finite value from finite inputs (views, metadata, copies of
# layout) or whose output is uninitialised memory (empty*): never checked. Keeping the forward
# cheap matters: these are a large share of the calls in a transformer.
_PASS_THROUGH_NAMES = (
    """__get__ __set__ size dim numel stride storage_offset data_ptr is_floating_point is_complex
    is_contiguous __len__ __bool__ __format__ __repr__ __iter__ __hash__ __index__ __int__ __float__
    item tolist requires_grad_ retain_grad register_hook backward view view_as reshape reshape_as
    transpose permute t mT T split split_with_sizes chunk unbind tensor_split __getitem__ __setitem__
    expand expand_as contiguous flatten unflatten squeeze unsqueeze detach detach_ narrow select
    movedim moveaxis as_strided unfold diagonal repeat_interleave broadcast_to broadcast_tensors
    empty empty_like empty_strided new_empty new_empty_strided cpu cuda pin_memory
    __reduce_ex__ __deepcopy__ __setstate__ untyped_storage _typed_storage""".split()
)


def op_name(func: Any) -> str:
    """A short readable name: ``Tensor.__matmul__`` -> ``matmul``, ``__truediv__`` -> ``div``."""
    name = getattr(func, "__name__", None) or str(func)
    name = name.strip("_")
    return {"truediv": "div", "rtruediv": "rdiv", "itruediv": "div_", "iadd": "add_", "isub": "sub_",
            "imul": "mul_", "rpow": "pow", "rmul": "mul", "radd": "add"}.get(name, name)


# Looked up by op_name: "__get__" (a property read such as ``p.grad`` or ``x.T``) is "get" here.
# (Matched against the raw names it never hit: property reads went through the checks, and reading
# a loss-scaled gradient that had overflowed, ``p.grad`` in the step, was taken for an op that made
# an infinity from finite inputs.)
PASS_THROUGH = frozenset(op_name(n) for n in _PASS_THROUGH_NAMES)

_OP_NAMES: dict[Any, str] = {}  # func -> op_name(func): the mode sees the same few hundred funcs


def _cached_op_name(func: Any) -> str:
    try:
        name = _OP_NAMES.get(func)
    except TypeError:  # an unhashable callable
        return op_name(func)
    if name is None:
        name = op_name(func)
        if len(_OP_NAMES) < 4096:  # bounded: a func bound to an object must not keep it alive forever
            _OP_NAMES[func] = name
    return name


def _scan(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], bool, bool]:
    """One pass over an op's arguments: its floating-point tensors (``out=`` left out) and whether
    a Python float among them is NaN or infinite (``masked_fill(m, -inf)`` asks for an infinity)."""
    tensors: list[torch.Tensor] = []
    nan = inf = False
    stack = list(args)
    if kwargs:
        stack.extend(v for k, v in kwargs.items() if k != "out")
        out = kwargs.get("out")
        if out is not None:  # its floats still count as asked for; its tensors are not inputs
            n, i = _scalar_flags(out)
            nan, inf = nan or n, inf or i
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                tensors.append(v)
        elif isinstance(v, float):
            if v != v:
                nan = True
            elif v in _INFS:
                inf = True
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    tensors.reverse()  # popped from the end: back into argument order
    return tensors, nan, inf


_INFS = (float("inf"), float("-inf"))


# functionals whose last positional argument may be ``inplace`` (nn.Dropout passes it positionally)
_INPLACE_FLAG = frozenset("""dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout relu relu6
    hardtanh elu selu celu leaky_relu threshold rrelu hardswish hardsigmoid silu mish""".split())


_IN_PLACE: dict[Any, bool] = {}  # func -> does it write into its first argument (mul_, __iadd__, __setitem__)?


def _writes_in_place(func: Any) -> bool:
    try:
        hit = _IN_PLACE.get(func)
    except TypeError:  # an unhashable callable
        hit = None
    if hit is None:
        raw = getattr(func, "__name__", "") or ""
        hit = (raw.endswith("_") and not raw.startswith("__")) or raw == "__setitem__" or (
            raw.startswith("__i") and raw.endswith("__") and raw not in ("__init__", "__index__", "__int__", "__invert__", "__iter__"))
        if len(_IN_PLACE) < 4096:
            try:
                _IN_PLACE[func] = hit
            except TypeError:
                pass
    return hit


_FUNC_INFO: dict[Any, tuple[str, bool, bool, bool]] = {}


def _func_info(func: Any) -> tuple[str, bool, bool, bool]:
    """What the op mode asks of every call, in one dict lookup: (short name, a pass-through op,
    writes into its first argument by its name, may take ``inplace`` as its last positional argument)."""
    try:
        hit = _FUNC_INFO.get(func)
    except TypeError:  # an unhashable callable
        hit = None
    if hit is None:
        name = _cached_op_name(func)
        hit = (name, name in PASS_THROUGH, _writes_in_place(func), name in _INPLACE_FLAG)
        if len(_FUNC_INFO) < 4096:  # bounded, as _OP_NAMES
            try:
                _FUNC_INFO[func] = hit
            except TypeError:
                pass
    return hit


def _force_inplace(stats: StatsBuffer, args: tuple, kwargs: dict) -> None:
    if args and isinstance(args[0], torch.Tensor):
        stats.force(args[0])
    out = kwargs.get("out")
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor):
            stats.force(t)
