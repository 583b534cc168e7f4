"""Tensor ranges measured on the device and read back in one transfer; finding tensors in arguments."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch

_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))

@dataclasses.dataclass(frozen=True)
class TensorRange:
    """What a tensor held: dtype, shape, smallest and largest value (NaN when it held a NaN)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    min: float
    max: float

    @property
    def nan(self) -> bool:
        return math.isnan(self.min) or math.isnan(self.max)

    @property
    def inf(self) -> bool:
        """Holds an infinity (unknown, reported False, when it also holds a NaN)."""
        return not self.nan and (math.isinf(self.min) or math.isinf(self.max))

    @property
    def finite(self) -> bool:
        return not (self.nan or self.inf)

    @property
    def absmax(self) -> float:
        return float("nan") if self.nan else max(abs(self.min), abs(self.max))

    def __str__(self) -> str:
        from mixprec.formats import get_format

        try:
            dt = get_format(self.dtype).name
        except ValueError:
            dt = str(self.dtype).removeprefix("torch.")
        shape = "x".join(map(str, self.shape)) or "scalar"
        if self.nan:
            return f"{dt}[{shape}] holding NaN"
        return f"{dt}[{shape}] in [{self.min:.4g}, {self.max:.4g}]"


# Tensors up to this many elements are measured lazily (see StatsBuffer): on a CPU a reduction over
# a small tensor costs its fixed overhead (~4 us), and a model of small tensors makes hundreds.
LAZY_NUMEL = 1 << 16


class StatsBuffer:
    """min/max of many tensors, computed where they live and read back in one transfer.

    ``add`` returns an index. A tensor already measured (same object, same version counter) is
    not measured again: a module's input is usually the previous op's output.

    With ``lazy``, a small tensor (``LAZY_NUMEL`` elements or fewer) is not reduced when added: it is
    kept, and ``read`` screens all of them with one ``_foreach_norm`` (an fp32 2-norm is finite
    exactly when the tensor is, barring overflow, which the exact check that follows catches).
    Only the ones that screen non-finite get their exact range then; the others get theirs when a
    ``Ranges`` index is asked for (the producer's inputs, on the rare path). Keeping the tensor
    means its value must not change before ``read``: ``force`` measures it first (the tracer calls
    it before an in-place op), and a tensor whose version moved anyway is measured as it is now.
    """

    def __init__(self, finite_only: bool = False, lazy: bool = False) -> None:
        self.finite_only = finite_only  # ranges of the finite values only: (0, largest finite |x|)
        self.lazy = lazy and not finite_only
        self._vals: list[torch.Tensor | None] = []
        self._meta: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._cache: dict[int, tuple[weakref.ref, int, int]] = {}
        self._lazy: dict[int, tuple[torch.Tensor, int]] = {}  # index -> (tensor, its version when added)

    def __len__(self) -> int:
        return len(self._meta)

    def add(self, t: torch.Tensor, cache: bool = True) -> int | None:
        # This runs for every tensor the guard sees (hundreds per step): the common case, a tensor
        # measured already, is answered from the cache before anything else is asked of it.
        if cache:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0]() is t:
                try:
                    if hit[1] == t._version:
                        return hit[2]
                except RuntimeError:
                    pass
        numel = t.numel()
        if numel == 0 or t.is_sparse or t.is_complex():
            return None
        version = -1
        if cache:
            try:
                version = t._version
            except RuntimeError:  # inference tensors have no version counter
                cache = False
        idx = len(self._meta)
        dtype = t.dtype
        self._meta.append((dtype, t.shape))
        if self.lazy and numel <= LAZY_NUMEL and dtype not in _FP8 and cache:
            self._lazy[idx] = (t, version)
            self._vals.append(None)
            self._vals.append(None)
        else:
            lo, hi = self._measure(t)
            self._vals.append(lo)
            self._vals.append(hi)
        if cache:
            self._cache[id(t)] = (weakref.ref(t), version, idx)
        return idx

    def _measure(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = t.detach() if t.is_contiguous() else _dense_view(t.detach())
        if t.dtype in _FP8:  # the fp8 linears' operands: no reduction kernels for fp8, exact in fp32
            m = m.float()
        if self.finite_only:
            hi = torch.nan_to_num(m.abs(), nan=0.0, posinf=0.0).amax()
            return torch.zeros_like(hi), hi
        return torch.aminmax(m)  # detach, not no_grad(): a context costs more than the op here

    def force(self, t: torch.Tensor) -> None:
        """Measure ``t`` now if it waits lazily (before an op overwrites it in place)."""
        hit = self._cache.get(id(t))
        if hit is None or hit[0]() is not t:
            return
        kept = self._lazy.pop(hit[2], None)
        if kept is not None:
            lo, hi = self._measure(t)
            self._vals[2 * hit[2]] = lo
            self._vals[2 * hit[2] + 1] = hi

    def read(self) -> "Ranges":
        """Every range added so far, in order (the one host sync), and empty the buffer."""
        vals, meta, lazy = self._vals, self._meta, self._lazy
        self._vals, self._meta, self._cache, self._lazy = [], [], {}, {}
        if not meta:
            return Ranges([], [])
        pending: dict[int, torch.Tensor] = {}
        if lazy:
            with torch.no_grad():
                items = list(lazy.items())
                for (i, (t, version)), ok in zip(items, _screen([t for _, (t, _) in items])):
                    if ok and _version(t) == version:
                        pending[i] = t  # finite: its range is measured if anyone asks for it (0.0 until then)
                    else:  # non-finite (or an overflowing sum, or changed since): measured exactly now
                        vals[2 * i], vals[2 * i + 1] = self._measure(t)
        # Only the measured values travel (a lazy tensor that screened finite has none): stacking a
        # placeholder per tensor cost as much as the screen of a small one.
        flat = [0.0] * len(vals)
        idxs = [j for j, v in enumerate(vals) if v is not None]
        if idxs:
            devices = {vals[j].device for j in idxs}
            for dev in devices:
                part = idxs if len(devices) == 1 else [j for j in idxs if vals[j].device == dev]
                # stack promotes to the widest dtype present: 16-bit values, inf and NaN survive exactly
                for j, v in zip(part, torch.stack([vals[j] for j in part]).cpu().tolist()):
                    flat[j] = v
        return Ranges(flat, meta, pending)


# Up to this many elements a tensor is screened with others of its dtype in one concatenation and
# one sum: on a CPU a per-tensor reduction costs ~1.5 us of fixed overhead, a copy of a small
# tensor much less. Larger tensors are screened in place (``_foreach_norm``): copying them would
# cost more than reading them.
SMALL_SCREEN = 4096


def _screen(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is finite, with one read per device.

    Large tensors: a 2-norm each (one ``_foreach_norm`` per dtype). Small ones: one sum over a
    concatenated copy of each dtype's tensors; a group whose sum is not finite is screened again,
    a norm each. Both give fp32 for fp16 and the tensor's own dtype otherwise (``_accumulate``). A
    norm or sum that overflows reads as not finite: the caller then measures that tensor exactly,
    so an overflow costs time, never a wrong answer."""
    out = [True] * len(tensors)
    groups: dict[tuple[bool, torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.numel() <= SMALL_SCREEN, t.dtype, t.device), []).append(i)
    checks: list[tuple[list[int], torch.Tensor]] = []  # (indices, one value per index, or one for the group)
    for (small, dtype, _), idx in groups.items():
        group = [tensors[i] for i in idx]
        if small and len(idx) > 1:
            checks.append((idx, torch._C._nn.flatten_dense_tensors(group).sum(**_accumulate(dtype)).reshape(1)))
        else:
            checks.append((idx, _norms(group)))
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, c) in enumerate(checks):
        by_device.setdefault(c.device, []).append(k)
    finite: list[list[bool]] = [[] for _ in checks]
    for ks in by_device.values():
        got = torch.cat([checks[k][1] for k in ks]).isfinite().cpu().tolist()
        pos = 0
        for k in ks:
            n = checks[k][1].numel()
            finite[k] = got[pos:pos + n]
            pos += n
    for (idx, _), ok in zip(checks, finite):
        if len(ok) < len(idx):  # a small group's one sum
            if ok[0]:
                continue
            ok = _norms([tensors[i] for i in idx]).isfinite().cpu().tolist()  # not finite as a whole: which?
        for i, f in zip(idx, ok):
            out[i] = f
    return out


def _accumulate(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """fp32 results for a dtype whose range is narrower than fp32's (fp16: a norm of values ~300
    overflows it); the tensor's own dtype otherwise. Asking fp32 of an fp32 or bf16 tensor is not
    free: a CPU ``_foreach_norm`` then takes a slower path (measured on 4.9M elements, AVX-512:
    fp32 1.59 against 1.36 ms, bf16 2.05 against 1.03 ms), and bf16 overflows where fp32 does."""
    return {"dtype": torch.float32} if torch.finfo(dtype).max < 2.0**127 else {}  # fp32's exponent range or wider


def _norms(group: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor of one dtype, stacked."""
    return torch.stack(torch._foreach_norm(group, 2, **_accumulate(group[0].dtype)))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dimensions reordered by stride, when that makes it contiguous (a transpose
    of a dense tensor): the same values, which a reduction walks several times faster."""
    st = t.stride()
    v = t.permute(sorted(range(t.dim()), key=st.__getitem__, reverse=True))
    return v if v.is_contiguous() else t


class Ranges(Sequence):
    """The ranges one ``StatsBuffer.read`` fetched, indexed like the buffer's ``add`` results.

    A ``TensorRange`` is built when an index is first asked for: a guard that finds every value
    finite (``all_finite``, the usual step) builds none.
    """

    __slots__ = ("_flat", "_meta", "_built", "_bad", "_pending")

    def __init__(self, flat: list[float], meta: list[tuple[torch.dtype, Any]],
                 pending: dict[int, torch.Tensor] | None = None) -> None:
        self._flat = flat
        self._meta = meta
        self._built: dict[int, TensorRange] = {}
        self._bad: dict[int, tuple[bool, bool]] | None = None
        self._pending = pending or {}  # lazily measured tensors that screened finite

    def __len__(self) -> int:
        return len(self._meta)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        r = self._built.get(i)
        if r is None:
            dt, shape = self._meta[i]  # IndexError past the end, as a list
            t = self._pending.pop(i, None)
            if t is not None:  # screened finite, not measured yet
                with torch.no_grad():
                    m = t.float() if t.dtype in _FP8 else t
                    lo, hi = torch.aminmax(m if m.is_contiguous() else m.contiguous())
                    self._flat[2 * i], self._flat[2 * i + 1] = float(lo), float(hi)
            r = self._built[i] = TensorRange(dt, tuple(shape), self._flat[2 * i], self._flat[2 * i + 1])
        return r

    @property
    def nonfinite(self) -> dict[int, tuple[bool, bool]]:
        """``{index: (nan, inf)}`` for the ranges that hold a NaN or an infinity (the same flags
        as ``TensorRange.nan``/``.inf``); an index not in it is finite."""
        if self._bad is None:
            flat, bad = self._flat, {}
            finite = list(map(math.isfinite, flat))  # at C speed; the loop below sees the few others
            for j in itertools.compress(range(len(flat)), map(operator.not_, finite)):
                i = j >> 1
                lo, hi = flat[2 * i], flat[2 * i + 1]
                nan = lo != lo or hi != hi
                bad[i] = (nan, not nan)
            self._bad = bad
        return self._bad

    @property
    def all_finite(self) -> bool:
        """True when no range holds a NaN or an infinity (no ``TensorRange`` is built to say so)."""
        return not self.nonfinite


def floating_tensors(obj: Any, skip_keys: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """Floating-point tensors in a nest of tuples, lists and dicts (a loop, not recursion: this
    runs for every op)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed([x for k, x in v.items() if k not in skip_keys]))
    return out


def _scalar_flags(obj: Any) -> tuple[bool, bool]:
    """(NaN, inf) among the Python floats of an op's arguments: ``masked_fill(m, -inf)`` asks for inf."""
    nan = inf = False
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            nan |= math.isnan(v)
            inf |= math.isinf(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return nan, inf


def _is_float(g: Any) -> bool:
    return isinstance(g, torch.Tensor) and g.is_floating_point()
