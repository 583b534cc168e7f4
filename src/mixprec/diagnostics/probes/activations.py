"""Activation range probe: which module outputs and ops come close to fp16's maximum?

Runs a forward under the tracer the NaN guard uses and keeps, per module and per op inside it
(``blocks.0 · matmul #1`` is ``q @ k.transpose(-2, -1)``), the largest magnitude seen. Anything
past the format's maximum would overflow; anything within ``headroom_bits`` of it is flagged.
Attention logits are the classic case.

Run it in fp32 to see the true magnitudes (a 16-bit run shows inf where they overflowed). To
judge only what a recipe computes in 16 bits, run it again under the recipe's autocast and pass
that report to ``at_risk_under``: ops the recipe keeps in fp32 (islands, losses) are then left out.

    report = probe_activation_range(model, lambda: model(x))
    [e.label for e in report.flagged()]
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._trace import Tracer
from mixprec.diagnostics.probes._common import check_args
from mixprec.formats import get_format, short_name

Key = tuple[str | None, str | None, int]  # (module, op or None for the module output, occurrence)


@dataclasses.dataclass(frozen=True)
class RangeEntry:
    """The largest magnitude one op (or one module output) produced.

    Attributes:
        module: qualified name (None: outside the model), module_type: its class.
        op: the torch call, None for the module's own output.
        occurrence: 0 for the first call of ``op`` in that module during the forward, 1 for the next...
        dtype: the output dtype in this run.
        absmax: the largest finite magnitude (NaN and inf are the guard's business, and an
            intentional -inf, a mask, must not hide the range of the rest).
        headroom_bits: log2(format max / absmax); negative means past the maximum.
        status: "overflow", "low-headroom" or "ok".
        where: source line of the op.
    """

    module: str | None
    module_type: str | None
    op: str | None
    occurrence: int
    dtype: torch.dtype
    absmax: float
    headroom_bits: float
    status: str
    where: str | None = None

    @property
    def key(self) -> Key:
        return (self.module, self.op, self.occurrence)

    @property
    def label(self) -> str:
        mod = "(outside the model)" if self.module is None else (self.module or "(model)")
        if self.op is None:
            return f"{mod} output"
        return f"{mod} · {self.op}" + (f" #{self.occurrence + 1}" if self.occurrence else "")


@dataclasses.dataclass
class ActivationRangeReport:
    entries: list[RangeEntry]
    fmt: str
    headroom_bits: float

    def flagged(self) -> list[RangeEntry]:
        """Entries past the maximum or with less than the asked headroom, largest first."""
        return sorted((e for e in self.entries if e.status != "ok"), key=lambda e: e.headroom_bits)

    def by_module(self) -> dict[str, float]:
        """Module name -> the largest magnitude any of its ops or its output produced."""
        out: dict[str, float] = {}
        for e in self.entries:
            if e.module is not None:
                out[e.module] = max(out.get(e.module, 0.0), e.absmax)
        return out

    def at_risk_under(self, recipe_run: "ActivationRangeReport") -> "ActivationRangeReport":
        """Keep the entries whose output ``recipe_run`` (the same forward under a recipe) had in 16 bits."""
        sixteen = {e.key for e in recipe_run.entries if e.dtype in (torch.float16, torch.bfloat16)}
        return ActivationRangeReport([e for e in self.entries if e.key in sixteen], self.fmt, self.headroom_bits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.fmt, "headroom_bits": self.headroom_bits,
            "entries": [
                {"label": e.label, "module": e.module, "op": e.op, "occurrence": e.occurrence,
                 "dtype": short_name(e.dtype) if e.dtype.is_floating_point else str(e.dtype),
                 "absmax": e.absmax, "headroom_bits": e.headroom_bits, "status": e.status, "where": e.where}
                for e in sorted(self.entries, key=lambda e: e.headroom_bits)
            ],
        }


def probe_activation_range(
    model: nn.Module,
    closure: Callable[[], Any],
    *,
    fmt: str = "f16",
    headroom_bits: float = 2.0,
    ops: bool = True,
) -> ActivationRangeReport:
    """Run ``closure`` (a forward, with or without the loss) and measure every op and module output.

    Args:
        model: the model whose modules name the ops.
        closure: runs the forward; its result is ignored. Run under ``torch.no_grad()`` if you like.
        fmt: the format whose maximum is the limit (fp16 by default; ``"e4m3"`` for fp8).
        headroom_bits: flag entries within 2^headroom_bits of the maximum (2: above a quarter of it).
        ops: measure each op inside forwards, not only module outputs.
    """
    check_args("probe_activation_range", model, closure)
    limit = get_format(fmt).max
    # finite values only: an intentional -inf (a causal mask) is not an activation out of range
    tracer = Tracer(model, ops=ops, backward=False, outside_modules=True, locate_ops=True, finite_only=True)
    tracer.attach()
    tracer.enter_scope()
    try:
        closure()
    finally:
        tracer.exit_scope()
        tracer.detach()
    records, ranges = tracer.take()
    best: dict[Key, tuple[float, torch.dtype, str | None, str | None]] = {}
    seen: Counter = Counter()
    from_ops = {i for rec in records if rec.op is not None for i in rec.outputs}
    for rec in records:
        if rec.phase != "forward":
            continue
        if rec.op is None and all(i in from_ops for i in rec.outputs):
            continue  # the module returned an op's output as it was: already an entry
        mod = None if rec.call is None else rec.call.name
        base = (mod, rec.op, rec.call.serial if rec.call is not None else 0)
        occurrence = seen[base]  # n-th call of this op in this call of the module
        seen[base] += 1
        key: Key = (mod, rec.op, occurrence)
        for i in rec.outputs:
            if i is None:
                continue
            r = ranges[i]
            prev = best.get(key)
            if prev is None or r.max > prev[0]:
                best[key] = (r.max, r.dtype, None if rec.call is None else rec.call.type, rec.where)
    entries = []
    for (mod, op, occ), (a, dtype, mtype, where) in best.items():
        head = math.log2(limit / a) if 0 < a < math.inf else (math.inf if a == 0 else -math.inf)
        status = "overflow" if a > limit else "low-headroom" if head < headroom_bits else "ok"
        entries.append(RangeEntry(mod, mtype, op, occ, dtype, a, head, status, where))
    return ActivationRangeReport(entries, get_format(fmt).name, headroom_bits)
