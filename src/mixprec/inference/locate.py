"""Where a low-precision forward goes wrong: the first module whose output turns non-finite, and
modules whose fp32 outputs come close to fp16's maximum.

Module granularity, with forward hooks: a module's forward hook runs when its forward returns,
children before parents, so the first hook that sees a non-finite output (where the fp32 model's
same module, same call, was finite) names the innermost module the value came out of. An op written
in a forward (``q @ k.T`` inside an attention block) is named by the module whose forward holds it;
the NaN guard (``mixprec.nan_guard``, and ``mixprec.probe_activation_range``) names the op itself.
The guard is a tool of its own (``mixprec.diagnostics``) that this tool may not import, and module
hooks are all this check needs to say where to look, so the little it needs is done here.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.inference.cast import dtype_name
from mixprec.inference.metrics import json_number


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _finite_absmax(obj: Any) -> torch.Tensor | None:
    """The largest finite magnitude among the floating tensors of ``obj`` (a 0-dim tensor, no sync)."""
    best = None
    for t in _tensors(obj):
        if t.numel():
            a = t.detach().abs()
            m = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).max().float()
            best = m if best is None else torch.maximum(best, m)
    return best


def _all_finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(obj))


class _Hooks:
    """Forward hooks on every module of a model (the model itself named ``""``), removed on exit."""

    def __init__(self, model: nn.Module, fn: Callable[[str, nn.Module, tuple, dict, Any], None]) -> None:
        self.model, self.fn, self.handles = model, fn, []

    def __enter__(self) -> "_Hooks":
        for name, module in self.model.named_modules():
            def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any, _name: str = name) -> None:
                self.fn(_name, mod, args, kwargs, output)
            self.handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class RangeRecorder:
    """The largest finite magnitude each module's output reaches, over every forward while open.

    Kept on the device (one sync in ``result``)."""

    def __init__(self, model: nn.Module) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.types: dict[str, str] = {}
        self._hooks = _Hooks(model, self._record)

    def _record(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        m = _finite_absmax(output)
        if m is not None:
            prev = self.absmax.get(name)
            self.absmax[name] = m if prev is None else torch.maximum(prev, m)
            self.types[name] = type(module).__name__

    def __enter__(self) -> "RangeRecorder":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def result(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.absmax.items()}


@dataclasses.dataclass(frozen=True)
class NearOverflow:
    """A module whose fp32 output comes within ``headroom_bits`` of a format's maximum (or past it)."""

    module: str
    module_type: str
    fp32_absmax: float
    limit: float

    @property
    def headroom_bits(self) -> float:
        return math.log2(self.limit / self.fp32_absmax) if self.fp32_absmax > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "module_type": self.module_type, "fp32_absmax": self.fp32_absmax,
                "limit": self.limit, "headroom_bits": json_number(self.headroom_bits)}


def near_overflow(recorder: RangeRecorder, dtype: torch.dtype, headroom_bits: float = 2.0,
                  most: int = 5) -> list[NearOverflow]:
    """Modules whose fp32 output peaks above ``max / 2**headroom_bits`` of ``dtype``, closest first."""
    limit = get_format(dtype).max
    rows = [NearOverflow(n or "(model)", recorder.types[n], a, limit) for n, a in recorder.result().items()
            if a > limit / 2**headroom_bits]
    return sorted(rows, key=lambda r: -r.fp32_absmax)[:most]


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first module whose low-precision output is non-finite where fp32's was finite.

    Attributes:
        module: qualified name (``"(model)"`` for the model's own forward), module_type: its class.
        call: 1 for the module's first call in the forward, 2 for the next (a shared module).
        cause: ``"overflow"`` (fp32's output there is past the format's maximum),
            ``"inside"`` (fp32's output is in range: an op inside the module's forward went
            non-finite: an intermediate past the maximum, such as attention logits, or a division
            by a value that rounded to 0), or ``"input"`` (its input was already non-finite: made by
            an op of the enclosing module's forward before the call).
        fp32_absmax: the largest magnitude the fp32 model's same module output reached.
        limit: the format's maximum.
        batch: index of the batch it was found on.
    """

    module: str
    module_type: str
    call: int
    cause: str
    fp32_absmax: float | None
    limit: float
    dtype: torch.dtype
    batch: int

    def describe(self) -> str:
        name = dtype_name(self.dtype)
        where = f"module {self.module!r} ({self.module_type})" + (f", call {self.call}" if self.call > 1 else "")
        peak = "" if self.fp32_absmax is None else f"{self.fp32_absmax:.4g}"
        if self.cause == "overflow":
            return (f"first non-finite output: {where}, batch {self.batch}: overflow: its fp32 output reaches "
                    f"{peak}, past {name}'s max {self.limit:.6g}. Use bf16 (fp32's range), or scale that "
                    "module's output down")
        if self.cause == "input":
            return (f"first non-finite value: it reached {where} already non-finite, batch {self.batch}: an op "
                    "of the enclosing module's forward made it before the call; mixprec.nan_guard names the op")
        return (f"first non-finite output: {where}, batch {self.batch}: its fp32 output peaks at {peak or '-'}, "
                f"within {name}'s max {self.limit:.6g}, so an op inside its forward went non-finite (an "
                "intermediate past the maximum, such as attention logits, or a division by a value that "
                "rounded to 0); mixprec.probe_activation_range and mixprec.nan_guard name the op")

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "module_type": self.module_type, "call": self.call, "cause": self.cause,
                "fp32_absmax": self.fp32_absmax, "limit": self.limit, "batch": self.batch,
                "message": self.describe()}


def locate_nonfinite(ref_model: nn.Module, low_model: nn.Module, run_ref: Callable[[], Any],
                     run_low: Callable[[], Any], dtype: torch.dtype, batch: int) -> Failure | None:
    """Run both forwards once more with hooks and name the first module whose ``low_model`` output is
    non-finite where ``ref_model``'s (the same module name, the same call) was finite. The two models
    must have the same module names (``low_model`` a cast copy of ``ref_model``)."""
    ref_peak: dict[tuple[str, int], float | None] = {}
    ref_finite: dict[tuple[str, int], bool] = {}
    ref_in_finite: dict[tuple[str, int], bool] = {}
    calls: Counter = Counter()

    def on_ref(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls[name] += 1
        key = (name, calls[name])
        m = _finite_absmax(output)
        ref_peak[key] = None if m is None else float(m)
        ref_finite[key] = _all_finite(output)
        ref_in_finite[key] = _all_finite((args, kwargs))

    with _Hooks(ref_model, on_ref):
        run_ref()
    found: list[Failure] = []
    low_calls: Counter = Counter()
    limit = get_format(dtype).max

    def on_low(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        low_calls[name] += 1
        key = (name, low_calls[name])
        if found or _all_finite(output) or not ref_finite.get(key, True):
            return
        peak = ref_peak.get(key)
        if ref_in_finite.get(key, True) and not _all_finite((args, kwargs)):
            cause = "input"
        elif peak is not None and peak > limit:
            cause = "overflow"
        else:
            cause = "inside"
        found.append(Failure(name or "(model)", type(module).__name__, key[1], cause, peak, limit, dtype, batch))

    with _Hooks(low_model, on_low):
        run_low()
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class ModuleError:
    """Where the error first grows past ``gate_db``: the first module (in the order forwards return)
    whose low-precision output has an SQNR under it. ``input_sqnr_db`` is its input's: when that is
    under the gate already, the error was made before the call, by an op of the enclosing module's
    forward (a difference of large, close values written in ``forward``)."""

    module: str
    module_type: str
    call: int
    sqnr_db: float
    input_sqnr_db: float | None
    gate_db: float
    batch: int

    def describe(self) -> str:
        where = f"{self.module!r} ({self.module_type})" + (f", call {self.call}" if self.call > 1 else "")
        if self.input_sqnr_db is not None and self.input_sqnr_db < self.gate_db:
            parent = self.module.rpartition(".")[0]
            owner = f"the forward of {parent!r}" if parent else "the model's own forward"
            return (f"the error passes {self.gate_db:g} dB before module {where}: its input's SQNR is already "
                    f"{self.input_sqnr_db:.1f} dB (batch {self.batch}), so an op in {owner} made it; look there "
                    "for a difference of large, close values or a long sum")
        return (f"the error first passes {self.gate_db:g} dB in module {where}: its output's SQNR is "
                f"{self.sqnr_db:.1f} dB (batch {self.batch}); look there for a difference of large, close values "
                "or a long sum")

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "module_type": self.module_type, "call": self.call,
                "sqnr_db": json_number(self.sqnr_db), "input_sqnr_db": json_number(self.input_sqnr_db),
                "gate_db": self.gate_db,
                "batch": self.batch, "message": self.describe()}


def _sqnr_of(ref: list[torch.Tensor], low: Any) -> float | None:
    lows = list(_tensors(low))
    if not ref or len(ref) != len(lows) or any(a.shape != b.shape for a, b in zip(ref, lows)):
        return None
    signal = noise = 0.0
    for a, b in zip(ref, lows):
        a, b = a.double(), b.double()
        ok = torch.isfinite(a) & torch.isfinite(b)
        a, b = torch.where(ok, a, 0.0), torch.where(ok, b, 0.0)
        signal += float((a * a).sum())
        noise += float(((b - a) ** 2).sum())
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


def locate_degradation(ref_model: nn.Module, low_model: nn.Module, run_ref: Callable[[], Any],
                       run_low: Callable[[], Any], gate_db: float, batch: int) -> ModuleError | None:
    """Run both forwards once more, keeping the fp32 modules' inputs and outputs (one batch's
    activations, twice), and name the first module whose low-precision output has an SQNR under ``gate_db``."""
    kept: dict[tuple[str, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    calls: Counter = Counter()

    def on_ref(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls[name] += 1
        kept[(name, calls[name])] = ([t.detach().clone() for t in _tensors((args, kwargs))],
                                     [t.detach().clone() for t in _tensors(output)])

    with _Hooks(ref_model, on_ref):
        run_ref()
    found: list[ModuleError] = []
    low_calls: Counter = Counter()

    def on_low(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        low_calls[name] += 1
        key = (name, low_calls[name])
        if found or key not in kept:
            return
        ref_in, ref_out = kept.pop(key)
        sq = _sqnr_of(ref_out, output)
        if sq is not None and sq < gate_db:
            found.append(ModuleError(name or "(model)", type(module).__name__, key[1], sq,
                                     _sqnr_of(ref_in, (args, kwargs)), gate_db, batch))

    with _Hooks(low_model, on_low):
        run_low()
    return found[0] if found else None
