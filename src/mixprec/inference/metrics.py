"""How far a low-precision output is from the fp32 one, accumulated over batches in float64.

- **SQNR** (dB): ``10 log10(sum ref^2 / sum (low - ref)^2)`` over every compared value of every
  batch (inf when the outputs are equal).
- **max abs error**: ``max |low - ref|``; **rel error**: that divided by ``max |ref|`` (a
  normwise relative error: elementwise ratios explode where fp32 is near 0).
- for class scores (the last dim indexes classes; logits or probabilities):
  **top-1**: the fraction of rows whose argmax is fp32's; **top-1 ties aside**: the same, counting
  a different pick as agreeing when fp32 itself scores it within ``tie`` (1%) of its row's range
  (max - min) of its own top-1: such a row is a near-tie that any rounding may flip, not a changed
  decision; **top-k**: the mean overlap of the two top-k sets (k = 5 when there are more than 5 classes).

Values where fp32 is not finite are left out (counted in ``ref_nonfinite``); values where fp32
is finite and the low-precision output is not are counted in ``nonfinite``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def flatten_outputs(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in a nest of tuples, lists and mappings (a Hugging Face
    ``ModelOutput`` is a mapping: ``logits``, ``hidden_states[1]``). A lone tensor is ``output``.
    Other objects (a key-value cache) are passed over."""
    if isinstance(obj, torch.Tensor):
        yield (prefix or "output"), obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from flatten_outputs(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten_outputs(v, f"{prefix}[{i}]" if prefix else f"[{i}]")


def sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


@dataclasses.dataclass
class OutputStats:
    """One output's comparison, over every batch so far (``add`` one batch at a time)."""

    name: str
    shape: tuple[int, ...]
    classes: bool  # the last dim indexes classes: top-1 / top-k are measured
    topk: int = 5
    tie: float = 0.01
    values: int = 0  # values finite in fp32
    compared: int = 0  # of those, finite in low precision too: what SQNR and the errors are over
    signal: float = 0.0  # sum ref^2
    noise: float = 0.0  # sum (low - ref)^2
    max_abs_err: float = 0.0
    max_abs_ref: float = 0.0
    nonfinite: int = 0  # fp32 finite, low precision not
    ref_nonfinite: int = 0
    worst_batch_sqnr: float = math.inf
    rows: int = 0
    top1_agree: int = 0
    top1_agree_ties: int = 0
    topk_rows: int = 0  # rows with more than topk classes
    topk_overlap: float = 0.0  # sum over those rows of |top-k(ref) & top-k(low)| / k

    def add(self, ref: torch.Tensor, low: torch.Tensor) -> None:
        r, o = ref.detach().double(), low.detach().double()
        finite = torch.isfinite(r)
        bad = finite & ~torch.isfinite(o)
        ok = finite & ~bad
        err = torch.where(ok, o - r, torch.zeros_like(r))
        r0 = torch.where(finite, r, torch.zeros_like(r))
        signal, noise = float((r0 * r0).sum()), float((err * err).sum())
        self.values += int(finite.sum())
        self.compared += int(ok.sum())
        self.ref_nonfinite += int((~finite).sum())
        self.nonfinite += int(bad.sum())
        self.signal += signal
        self.noise += noise
        if r.numel():
            self.max_abs_err = max(self.max_abs_err, float(err.abs().max()))
            self.max_abs_ref = max(self.max_abs_ref, float(r0.abs().max()))
        if ok.any():
            self.worst_batch_sqnr = min(self.worst_batch_sqnr, sqnr_db(signal, noise))
        if self.classes:
            self._add_classes(r, o, finite)

    def _add_classes(self, r: torch.Tensor, o: torch.Tensor, finite: torch.Tensor) -> None:
        c = r.shape[-1]
        r, o, finite = r.reshape(-1, c), o.reshape(-1, c), finite.reshape(-1, c)
        use = finite.any(-1)  # rows where fp32 scores some class (an all -inf row decides nothing)
        r, o, finite = r[use], o[use], finite[use]
        if not r.shape[0]:
            return
        spoilt = (finite & ~torch.isfinite(o)).any(-1)  # a row with a NaN or inf fp32 has not: no pick at all
        o = torch.where(torch.isnan(o), torch.full_like(o, -math.inf), o)
        top_r, top_o = r.argmax(-1), o.argmax(-1)
        agree = (top_r == top_o) & ~spoilt
        hi = torch.where(finite, r, torch.full_like(r, -math.inf)).max(-1).values
        lo = torch.where(finite, r, torch.full_like(r, math.inf)).min(-1).values
        picked = r.gather(-1, top_o[:, None])[:, 0]
        near = ((hi - picked) <= self.tie * (hi - lo)) & ~spoilt  # fp32 scores the other pick within tie of its own
        self.rows += int(r.shape[0])
        self.top1_agree += int(agree.sum())
        self.top1_agree_ties += int((agree | near).sum())
        if c > self.topk:
            kr = r.topk(self.topk, dim=-1).indices
            ko = o.topk(self.topk, dim=-1).indices
            self.topk_rows += int(r.shape[0])
            shared = (kr[:, :, None] == ko[:, None, :]).any(-1).sum(-1) * ~spoilt
            self.topk_overlap += float(shared.sum()) / self.topk

    # ------------------------------------------------------------------ results

    @property
    def sqnr(self) -> float:
        """NaN when no value was finite in both (nothing to measure the noise of)."""
        return sqnr_db(self.signal, self.noise) if self.compared else math.nan

    @property
    def rel_err(self) -> float:
        if self.max_abs_ref == 0:
            return 0.0 if self.max_abs_err == 0 else math.inf
        return self.max_abs_err / self.max_abs_ref

    @property
    def top1(self) -> float | None:
        return self.top1_agree / self.rows if self.rows else None

    @property
    def top1_ties_aside(self) -> float | None:
        return self.top1_agree_ties / self.rows if self.rows else None

    @property
    def topk_mean(self) -> float | None:
        return self.topk_overlap / self.topk_rows if self.topk_rows else None

    def merged(self, other: "OutputStats", name: str) -> "OutputStats":
        """The pooled comparison of two outputs (the "all outputs" row)."""
        out = OutputStats(name, (), self.classes or other.classes, self.topk, self.tie)
        for f in ("values", "compared", "signal", "noise", "nonfinite", "ref_nonfinite", "rows", "top1_agree",
                  "top1_agree_ties", "topk_rows", "topk_overlap"):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        for f in ("max_abs_err", "max_abs_ref"):
            setattr(out, f, max(getattr(self, f), getattr(other, f)))
        out.worst_batch_sqnr = min(self.worst_batch_sqnr, other.worst_batch_sqnr)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "shape": list(self.shape), "classes": self.classes, "values": self.values,
            "compared": self.compared,
            "sqnr_db": json_number(self.sqnr), "worst_batch_sqnr_db": json_number(self.worst_batch_sqnr),
            "max_abs_err": json_number(self.max_abs_err), "rel_err": json_number(self.rel_err),
            "nonfinite": self.nonfinite, "ref_nonfinite": self.ref_nonfinite, "rows": self.rows,
            "top1": self.top1, "top1_ties_aside": self.top1_ties_aside,
            f"top{self.topk}_overlap": self.topk_mean, "tie": self.tie,
        }


def json_number(x: float | None) -> float | str | None:
    """JSON has no inf: "inf" / "-inf" as strings."""
    if x is None or math.isfinite(x):
        return x
    return "inf" if x > 0 else "-inf" if x < 0 else "nan"
