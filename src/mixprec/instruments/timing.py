"""Timing harness: interleaved repetitions, device-honest clocks, medians and paired ratios.

Why interleave: on a shared machine the load drifts over minutes. Timing variant A for a minute and
then B for a minute measures the drift as much as the variants. Here every round runs each variant
once, in an order rotated by one each round, so slow periods hit all variants alike and no variant
always runs right after the same neighbour; ratios are then formed per round (paired), which
cancels the drift that is common to a round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch


def interleaved_order(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) pairs: every name once per round, the order rotated by one each round.

    >>> interleaved_order(["a", "b", "c"], 2)
    [(0, 'a'), (0, 'b'), (0, 'c'), (1, 'b'), (1, 'c'), (1, 'a')]
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(names)
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    n = len(names)
    return [(r, names[(r + i) % n]) for r in range(rounds) for i in range(n)] if n else []


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock read after it includes that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, repeat: int = 1) -> float:
    """Seconds per call of ``fn``, averaged over ``repeat`` back-to-back calls (syncs at both ends only)."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / repeat


@dataclasses.dataclass(frozen=True)
class Summary:
    """Order statistics of a sample (seconds, or a ratio)."""

    median: float
    q25: float
    q75: float
    min: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Summary":
        if len(samples) == 0:
            raise ValueError("cannot summarize an empty sample")
        a = np.asarray(samples, dtype=np.float64)
        q25, med, q75 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(q25), float(q75), float(a.min()), int(a.size))

    @property
    def rel_iqr(self) -> float:
        """Interquartile range over the median: the noise of this measurement."""
        return (self.q75 - self.q25) / self.median if self.median else math.nan

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def bootstrap_median_ci(samples: Sequence[float], level: float = 0.95, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval for the median of ``samples``."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        raise ValueError("cannot bootstrap an empty sample")
    rng = np.random.default_rng(seed)
    medians = np.median(a[rng.integers(0, a.size, size=(draws, a.size))], axis=1)
    lo, hi = np.percentile(medians, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def paired_ratio(numer: Sequence[float], denom: Sequence[float]) -> dict[str, float]:
    """Per-round ratios ``numer[i] / denom[i]``: median, IQR and a 95% bootstrap interval of the median."""
    if len(numer) != len(denom) or not numer:
        raise ValueError(f"paired samples must be non-empty and of equal length, got {len(numer)} and {len(denom)}")
    ratios = [a / b for a, b in zip(numer, denom)]
    s = Summary.of(ratios)
    lo, hi = bootstrap_median_ci(ratios)
    return {"median": s.median, "q25": s.q25, "q75": s.q75, "ci95_low": lo, "ci95_high": hi, "n": s.n}


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[list[int]]:
    """Count host-device synchronizations inside the block (CUDA only) with
    ``torch.cuda.set_sync_debug_mode("warn")``; the count is in ``box[0]`` after the block.

    It sees what torch instruments (``.item()``, ``nonzero``, blocking copies to the host, ...), not
    syncs made by third-party code calling the CUDA runtime directly.
    """
    box = [0]
    if device.type != "cuda":
        raise ValueError(f"sync counting needs a CUDA device, got {device}")
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # one warning per sync, not one per source line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    box[0] = sum("synchroniz" in str(w.message) for w in caught)
