"""Gradient underflow probe: where would this model's gradients land in fp16, bf16 and fp8?

From one fp32 backward it keeps, per parameter gradient and per module output (activation)
gradient, the histogram of log2|g| and exact counts of the values that would become zero, stay
subnormal, or overflow when multiplied by a loss scale S and rounded to each format, for every
power-of-two S in a range. This is the figure of the mixed-precision paper (Micikevicius et al.
2017), measured on your model, plus the scale to start from.

Exact, not binned: the boundaries between categories (``rounding_thresholds``) divided by each S
are sorted once and every |g| is bucketed against all of them in one ``torch.bucketize`` pass, so
each count equals what casting ``g * S`` to the format and counting would give (the tests check
this against real casts).

    report = probe_grad_underflow(model, lambda: F.cross_entropy(model(x), y))
    report.landing("layers.0.weight", "f16", scale=1.0).zero   # fraction flushed to 0 without scaling
    report.recommended_scale                                   # largest 2^k with headroom below 65504
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.probes._common import (
    DEFAULT_FORMATS, GradSnapshot, check_args, formats, pow2_label, rounding_thresholds, run_backward,
)
from mixprec.formats import get_format
from mixprec.fp8 import CastObserver, CastStats, preserve_scaling_state

HIST_LO, HIST_HI = -160, 130  # floor(log2|g|) bins: fp32 spans 2^-149 .. 2^128
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class Landing:
    """Where the nonzero finite fp32 values land when scaled by ``scale`` and cast to ``fmt``
    (fractions of those values). ``zero_norm`` says whether the lost values mattered: a parameter
    can lose half its elements to underflow and almost none of its gradient."""

    fmt: str
    scale: float
    zero: float
    subnormal: float
    overflow: float
    zero_norm: float = 0.0  # share of the gradient's squared L2 norm carried by the values flushed to 0

    @property
    def normal(self) -> float:
        return 1.0 - self.zero - self.subnormal - self.overflow


class _Grid:
    """The sorted boundaries for every (format, scale): a value ``a`` falls at or below boundary j
    when ``bucketize(a, boundaries) <= j``."""

    def __init__(self, fmts: Sequence[str], scales: Sequence[float]) -> None:
        self.formats = tuple(get_format(f).name for f in fmts)
        self.scales = tuple(sorted(set(float(s) for s in scales)))
        raw: dict[tuple[str, float], tuple[float, float, float]] = {}
        for f in formats(self.formats):
            zero, normal, over = rounding_thresholds(f)
            for s in self.scales:
                # "a < t" is "a <= the double just below t": all comparisons become <=
                raw[(f.name, s)] = (zero / s, math.nextafter(normal / s, 0.0), math.nextafter(over / s, 0.0))
        values = sorted({v for triple in raw.values() for v in triple})
        self.boundaries = torch.tensor(values, dtype=torch.float64)
        pos = {v: i for i, v in enumerate(values)}
        self.index = {k: tuple(pos[v] for v in triple) for k, triple in raw.items()}


@dataclasses.dataclass
class GradStats:
    """One gradient (a parameter's, or a module's output gradient), accumulated over calls.

    Attributes:
        name: parameter name or module qualified name.
        kind: "param", "activation" or "module" (a module's parameters together).
        total: finite values seen; zeros: of them exactly 0 in fp32; nonfinite: inf/NaN values.
        absmax, absmin: largest and smallest nonzero magnitude.
        hist: counts per floor(log2|g|) for nonzero values; bin i is exponent ``HIST_LO + i``.
    """

    name: str
    kind: str
    grid: _Grid = dataclasses.field(repr=False)
    total: int = 0
    zeros: int = 0
    nonfinite: int = 0
    absmax: float = 0.0
    absmin: float = math.inf
    hist: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(HIST_HI - HIST_LO, dtype=torch.int64), repr=False)
    le: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    sq_le: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # sum of g^2 at or below each boundary
    sumsq: float = 0.0

    @property
    def nonzero(self) -> int:
        return self.total - self.zeros

    def add(self, g: torch.Tensor) -> None:
        flat = g.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            self._add_chunk(flat[start:start + _CHUNK])

    def _add_chunk(self, g: torch.Tensor) -> None:
        a = g.double().abs()
        finite = torch.isfinite(a)
        n_bad = int((~finite).sum())
        if n_bad:
            self.nonfinite += n_bad
            a = a[finite]
        if a.numel() == 0:
            return
        self.total += a.numel()
        self.zeros += int((a == 0).sum())
        nz = a[a > 0]
        bnd = self.grid.boundaries.to(a.device)
        idx = torch.bucketize(a, bnd)
        le = torch.bincount(idx, minlength=bnd.numel() + 1)[: bnd.numel()].cumsum(0).cpu()
        sq = a * a
        sq_le = torch.bincount(idx, weights=sq, minlength=bnd.numel() + 1)[: bnd.numel()].cumsum(0).cpu()
        self.le = le if self.le is None else self.le + le
        self.sq_le = sq_le if self.sq_le is None else self.sq_le + sq_le
        self.sumsq += float(sq.sum())
        if nz.numel():
            self.absmax = max(self.absmax, float(nz.max()))
            self.absmin = min(self.absmin, float(nz.min()))
            exp = torch.frexp(nz).exponent.to(torch.int64) - 1  # floor(log2 a): a = m * 2^e, m in [0.5, 1)
            self.hist += torch.bincount((exp - HIST_LO).clamp(0, HIST_HI - HIST_LO - 1), minlength=HIST_HI - HIST_LO).cpu()

    def merge(self, other: "GradStats") -> None:
        self.total += other.total
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite
        self.absmax = max(self.absmax, other.absmax)
        self.absmin = min(self.absmin, other.absmin)
        self.hist = self.hist + other.hist
        if other.le is not None:
            self.le = other.le.clone() if self.le is None else self.le + other.le
            self.sq_le = other.sq_le.clone() if self.sq_le is None else self.sq_le + other.sq_le  # type: ignore[union-attr]
        self.sumsq += other.sumsq

    def landing(self, fmt: str = "f16", scale: float = 1.0) -> Landing:
        """Fractions of the nonzero values that would flush to 0 / be subnormal / overflow."""
        name = get_format(fmt).name
        key = (name, float(scale))
        if key not in self.grid.index:
            raise KeyError(
                f"scale {scale:g} in {name} was not measured; measured formats {self.grid.formats} at scales "
                f"{pow2_label(self.grid.scales[0])}..{pow2_label(self.grid.scales[-1])} (powers of two) and any "
                "passed as scales= to probe_grad_underflow"
            )
        if self.le is None or self.nonzero == 0:
            return Landing(name, float(scale), 0.0, 0.0, 0.0)
        iz, isub, iover = self.grid.index[key]
        le = self.le
        zero = int(le[iz]) - self.zeros
        sub = int(le[isub]) - int(le[iz])
        over = self.total - int(le[iover])
        n = self.nonzero
        lost = float(self.sq_le[iz]) / self.sumsq if self.sq_le is not None and self.sumsq > 0 else 0.0  # type: ignore[index]
        return Landing(name, float(scale), zero / n, sub / n, over / n, lost)

    def to_dict(self, fmts: Sequence[str], scales: Sequence[float]) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "values": self.total, "zeros": self.zeros,
            "nonfinite": self.nonfinite, "absmax": self.absmax, "absmin": None if self.absmin == math.inf else self.absmin,
            "landing": {f"{get_format(f).name}@{pow2_label(s)}": dataclasses.asdict(self.landing(f, s))
                        for f in fmts for s in scales},
        }


@dataclasses.dataclass
class GradUnderflowReport:
    """What ``probe_grad_underflow`` measured.

    Attributes:
        params: one ``GradStats`` per parameter with a gradient.
        activations: one per module output gradient (leaf modules and containers alike).
        overall: parameters and leaf-module activations together (the paper's histogram).
        recommended_scale: the largest power of two that keeps the largest gradient
            ``headroom_bits`` below fp16's maximum (None when every gradient was 0).
        headroom_bits, formats, scales: what was asked.
        fp8: for a model with fp8 layers (an fp8 recipe's), one ``mixprec.fp8.CastStats`` per fp8
            layer and tensor (input, weight, grad_output): the fraction of values its cast flushed to
            zero or saturated at its current scale, and the cast's SQNR.
    """

    params: list[GradStats]
    activations: list[GradStats]
    overall: GradStats
    recommended_scale: float | None
    headroom_bits: int
    formats: tuple[str, ...]
    scales: tuple[float, ...]
    fp8: list[CastStats] = dataclasses.field(default_factory=list)

    def get(self, name: str) -> GradStats:
        for s in (*self.params, *self.activations):
            if s.name == name:
                return s
        raise KeyError(f"no gradient named {name!r}; parameters: {[p.name for p in self.params][:8]}...")

    def landing(self, name: str, fmt: str = "f16", scale: float = 1.0) -> Landing:
        return self.get(name).landing(fmt, scale)

    def by_module(self) -> list[GradStats]:
        """Parameter gradients merged per owning module (``layers.0.weight`` + ``.bias`` -> ``layers.0``)."""
        out: dict[str, GradStats] = {}
        for p in self.params:
            owner = p.name.rpartition(".")[0]
            if owner not in out:
                out[owner] = GradStats(owner, "module", self.overall.grid)
            out[owner].merge(p)
        return list(out.values())

    def worst(self, fmt: str = "f16", scale: float = 1.0, kind: str = "param", n: int = 10) -> list[tuple[GradStats, Landing]]:
        """The ``n`` gradients with the largest flushed-to-zero fraction at ``scale``."""
        pool = {"param": self.params, "activation": self.activations, "module": self.by_module()}[kind]
        ranked = sorted(((s, s.landing(fmt, scale)) for s in pool if s.nonzero), key=lambda t: -t[1].zero)
        return ranked[:n]

    def to_dict(self, scales: Sequence[float] | None = None) -> dict[str, Any]:
        scales = list(scales) if scales is not None else [1.0] + ([self.recommended_scale] if self.recommended_scale else [])
        return {
            "recommended_scale": self.recommended_scale,
            "headroom_bits": self.headroom_bits,
            "overall": self.overall.to_dict(self.formats, scales),
            "params": [p.to_dict(("f16",), scales) for p in self.params],
            "activations": [a.to_dict(("f16",), scales) for a in self.activations],
            "fp8": [c.to_dict() for c in self.fp8],
        }


def probe_grad_underflow(
    model: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
    scale_exponents: tuple[int, int] = (-16, 48),
    scales: Iterable[float] = (),
    headroom_bits: int = 1,
    activations: bool = True,
) -> GradUnderflowReport:
    """Run ``closure`` (forward and loss, in fp32: no autocast) and one backward, and measure.

    Args:
        model: the model; its existing ``.grad`` tensors are set aside and restored.
        closure: returns the scalar loss.
        formats: where to land the gradients (any of ``mixprec.formats``).
        scale_exponents: measure every scale 2^k for k in this inclusive range.
        scales: further scales to measure (any positive values).
        headroom_bits: the recommended scale keeps the largest gradient 2^headroom_bits below fp16's max.
        activations: also measure each module's output gradient (tensor hooks, removed after).
    """
    check_args("probe_grad_underflow", model, closure)
    lo, hi = scale_exponents
    grid = _Grid(formats, [2.0**k for k in range(lo, hi + 1)] + [float(s) for s in scales])
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    snap = GradSnapshot([p for _, p in params])
    acts: dict[str, GradStats] = {}
    leaves = {name for name, m in model.named_modules() if not any(True for _ in m.children())}
    handles = []

    def on_grad(name: str, g: torch.Tensor) -> None:
        name = name or "(model)"
        acts.setdefault(name, GradStats(name, "activation", grid)).add(g)

    def on_forward(name: str, module: nn.Module, args: Any, output: Any) -> None:
        outs = [output] if isinstance(output, torch.Tensor) else [o for o in output if isinstance(o, torch.Tensor)] \
            if isinstance(output, (tuple, list)) else []
        for t in outs:
            if t.is_floating_point() and t.requires_grad:
                t.register_hook(functools.partial(on_grad, name))

    snap.clear()
    casts = CastObserver(model)  # an fp8 model's casts, measured in the same backward (none otherwise)
    try:
        casts.attach()
        if activations:
            for name, m in model.named_modules():
                handles.append(m.register_forward_hook(functools.partial(on_forward, name)))
        try:
            with preserve_scaling_state(model):
                run_backward(closure, "probe_grad_underflow")
        finally:
            for h in handles:
                h.remove()
            casts.detach()
        pstats: list[GradStats] = []
        for name, p in params:
            if p.grad is not None:
                s = GradStats(name, "param", grid)
                s.add(p.grad)
                pstats.append(s)
    finally:
        snap.restore()
    overall = GradStats("(all)", "overall", grid)
    for s in pstats:
        overall.merge(s)
    for name, s in acts.items():
        if name in leaves or (name == "(model)" and "" in leaves):
            overall.merge(s)
    f16 = get_format("f16")
    rec = None
    if overall.absmax > 0:
        k = math.floor(math.log2(f16.max / overall.absmax)) - headroom_bits
        rec = 2.0 ** min(max(k, lo), hi)  # within the measured range, so its landing can be read
    return GradUnderflowReport(pstats, list(acts.values()), overall, rec, headroom_bits, grid.formats, grid.scales,
                               casts.read())
