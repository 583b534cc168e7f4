"""Step records read in batches: the loss scale's sawtooth and skipped steps without a host sync per step.

``MixedPrecision.step`` returns a ``StepStats`` whose fields are device tensors. ``StepLog``
keeps them on the device (one small stack per step, no sync) and reads a batch of steps back in
one transfer when asked (``flush``) or when ``every`` steps have gathered (``append`` returns
them then). Each record is ``(step, metrics)`` with plain floats, ready for any logger:

    log = StepLog(every=50)
    for x, y in batches:
        ...
        for step, metrics in log.append(mp.step(loss, opt)):
            wandb.log(metrics, step=step)            # or mlflow.log_metrics(metrics, step=step)

``metrics`` holds ``{prefix}loss``, ``{prefix}loss_scale`` (the scale that step's backward used),
``{prefix}skipped`` (1.0 for a step skipped on inf/NaN gradients, else 0.0) and, when the step
measured it, ``{prefix}grad_norm`` (the unscaled norm before clipping).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.training import StepStats

FIELDS = ("loss", "loss_scale", "skipped", "grad_norm")


class StepLog:
    """A device-side buffer of step records, read back ``every`` steps in one transfer.

    Args:
        every: how many optimizer steps to gather before ``append`` hands them back (>= 1).
        prefix: put before each metric name (``"mixprec/"`` -> ``"mixprec/loss_scale"``).

    Micro-steps of an accumulation window (``stats.stepped`` False) are not recorded.
    """

    def __init__(self, every: int = 50, prefix: str = "mixprec/") -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (steps per read-back), got {every!r}")
        self.every = every
        self.prefix = prefix
        self._steps: list[int] = []
        self._measured: list[bool] = []
        self._rows: list[torch.Tensor] = []
        self._nan: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def append(self, stats: StepStats) -> list[tuple[int, dict[str, float]]]:
        """Keep one step's record (no sync); returns the batch once ``every`` steps gathered, else []."""
        if not isinstance(stats, StepStats):
            raise TypeError(f"StepLog.append expects the StepStats that mp.step returns, got {type(stats).__name__}")
        if not stats.stepped:
            return []
        device = stats.loss.device
        nan = self._nan.get(device)
        if nan is None:
            nan = self._nan[device] = torch.full((), math.nan, device=device)
        norm = nan if stats.grad_norm is None else stats.grad_norm
        row = torch.stack([t.detach().to(device=device, dtype=torch.float32)
                           for t in (stats.loss, stats.scale, stats.skipped, norm)])
        self._rows.append(row)
        self._steps.append(stats.step)
        self._measured.append(stats.grad_norm is not None)
        return self.flush() if len(self._rows) >= self.every else []

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        """Every buffered record, oldest first, as ``(step, metrics)``: one host transfer."""
        if not self._rows:
            return []
        values = torch.stack(self._rows).cpu().tolist()
        steps, measured = self._steps, self._measured
        self._rows, self._steps, self._measured = [], [], []
        out = []
        for step, has_norm, row in zip(steps, measured, values):
            metrics = {self.prefix + name: v for name, v in zip(FIELDS, row)}
            if not has_norm:
                del metrics[self.prefix + "grad_norm"]  # not measured this step
            out.append((step, metrics))
        return out

    def __iter__(self) -> Iterator[tuple[int, dict[str, float]]]:
        return iter(self.flush())

    def __repr__(self) -> str:
        return f"StepLog(every={self.every}, buffered={len(self._rows)})"


def summarize(records: list[tuple[int, dict[str, Any]]], prefix: str = "mixprec/") -> dict[str, float]:
    """One dict for a window of records (a logger that takes one value per log call): the last
    step's scale and loss, the smallest scale seen, and how many steps were skipped."""
    if not records:
        return {}
    last = records[-1][1]
    out = {
        prefix + "loss_scale": last[prefix + "loss_scale"],
        prefix + "loss_scale_min": min(m[prefix + "loss_scale"] for _, m in records),
        prefix + "skipped_steps": float(sum(m[prefix + "skipped"] for _, m in records)),
    }
    if prefix + "grad_norm" in last:
        out[prefix + "grad_norm"] = last[prefix + "grad_norm"]
    return out
