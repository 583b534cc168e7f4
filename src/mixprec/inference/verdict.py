"""The verdict on a low-precision output: agree, degraded or broken, from stated thresholds.

Per output (each floating tensor the forward returns), in this order:

- **broken**: a value is non-finite where fp32's is finite; or SQNR < 20 dB; or, for class
  scores, top-1 agreement (near-ties aside) < 90%.
- **degraded**: SQNR < 30 dB, or top-1 agreement (near-ties aside) < 99%.
- **agree**: otherwise.

A dtype's verdict is its worst output's (or broken when its forward raised); a report's, its worst
dtype's.

Why these numbers. A 16-bit float keeps 8 (bf16) or 11 (fp16) significant bits: rounding a
Gaussian tensor once gives an SQNR of 55.6 dB (bf16) or 73.7 dB (fp16), and a network's layers add
their errors up to somewhat less (the built-in char GPT: 50-53 dB in bf16, 68-71 dB in fp16; tiny GPT-2 and Llama
configs: ~50 / ~68 dB). 30 dB (an RMS error of 3% of the signal) is what PyTorch's quantized-model
numerics test asks of an int8 model and what torchao's tests ask of int4/int8 weight quantisation:
a plain 16-bit float cast that does worse than an int8 quantisation is expected to has lost
something. Below 20 dB (10% RMS error) is worse than torchao's tests accept even of fp8 (25 dB for one
fp8 matmul, a little less for a whole MoE layer) and of MX-fp8 casts (18 dB): broken. Top-1: a healthy bf16 cast flips 1-1.5% of a language model's argmaxes
(the built-in char GPT, untrained and after 200 steps) at rows where fp32's top two are nearly
tied, which a plain 99% gate would call degraded; counting a flip to a class fp32 scores within 1%
of its row's range of its own top-1 as agreement removes those (all of them on the char GPT) and
leaves 99% for agree and 90% for broken meaning changed decisions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mixprec.inference.metrics import OutputStats

VERDICTS = ("agree", "degraded", "broken")


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The gates of the verdict (see the module's docstring for where they come from)."""

    agree_sqnr_db: float = 30.0
    broken_sqnr_db: float = 20.0
    agree_top1: float = 0.99
    broken_top1: float = 0.90
    tie: float = 0.01  # a flip to a class fp32 scores within tie * (row max - row min) of its top-1 agrees

    def __post_init__(self) -> None:
        if not self.broken_sqnr_db <= self.agree_sqnr_db:
            raise ValueError(f"Thresholds: broken_sqnr_db ({self.broken_sqnr_db}) must be <= agree_sqnr_db "
                             f"({self.agree_sqnr_db})")
        if not 0 <= self.broken_top1 <= self.agree_top1 <= 1:
            raise ValueError(f"Thresholds: need 0 <= broken_top1 ({self.broken_top1}) <= agree_top1 "
                             f"({self.agree_top1}) <= 1")
        if not 0 <= self.tie < 1:
            raise ValueError(f"Thresholds: tie must be in [0, 1), got {self.tie}")

    def describe(self) -> str:
        return (f"agree: SQNR >= {self.agree_sqnr_db:g} dB and top-1 >= {self.agree_top1:.0%} (near-ties aside); "
                f"broken: non-finite where fp32 is finite, SQNR < {self.broken_sqnr_db:g} dB or top-1 < "
                f"{self.broken_top1:.0%}; degraded: in between")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def worst(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICTS.index) if verdicts else "agree"


def judge(stats: OutputStats, th: Thresholds) -> tuple[str, list[str]]:
    """(verdict, reasons): each reason is one failed gate, naming the output."""
    found: list[tuple[str, str]] = []
    if stats.nonfinite:
        found.append(("broken", f"{stats.name}: {stats.nonfinite} non-finite value(s) where fp32 is finite"))
    sq = stats.sqnr
    if sq < th.broken_sqnr_db:
        found.append(("broken", f"{stats.name}: SQNR {sq:.1f} dB < {th.broken_sqnr_db:g}"))
    elif sq < th.agree_sqnr_db:
        found.append(("degraded", f"{stats.name}: SQNR {sq:.1f} dB < {th.agree_sqnr_db:g}"))
    top1 = stats.top1_ties_aside
    if top1 is not None:
        if top1 < th.broken_top1:
            found.append(("broken", f"{stats.name}: top-1 {top1:.1%} < {th.broken_top1:.0%}"))
        elif top1 < th.agree_top1:
            found.append(("degraded", f"{stats.name}: top-1 {top1:.1%} < {th.agree_top1:.0%}"))
    return worst([v for v, _ in found]), [r for _, r in found]
