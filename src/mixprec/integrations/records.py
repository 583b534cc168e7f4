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
measured it, ``{prefix}grad_norm`` (the unscaled norm before clipping). ``StepWindow`` keeps
only what the steps since its last read did (last and smallest scale, skipped count), in
constant memory, for loggers that take one value per log call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

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


class StepWindow:
    """What the steps since the last read did, kept on the device in constant memory: for a
    logger that takes one value per log call (the Hugging Face Trainer logs every
    ``logging_steps``). ``read()`` returns it and starts a new window (one host transfer).

    Keys: ``{prefix}loss_scale`` (the last step's), ``{prefix}loss_scale_min`` (the smallest
    scale in the window), ``{prefix}skipped_steps`` (how many were skipped) and, when the last
    step measured it, ``{prefix}grad_norm``.
    """

    def __init__(self, prefix: str = "mixprec/") -> None:
        self.prefix = prefix
        self.steps = 0
        self._last: StepStats | None = None
        self._min: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None

    def append(self, stats: StepStats) -> None:
        """Fold one step into the window (no sync)."""
        if not stats.stepped:
            return
        scale = stats.scale.detach().float()
        skipped = stats.skipped.detach().float()
        self._min = scale if self._min is None else torch.minimum(self._min, scale)
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        self._last, self.steps = stats, self.steps + 1

    def read(self) -> dict[str, float]:
        """The window's summary as floats ({} when no step ran since the last read)."""
        last = self._last
        if last is None or self._min is None or self._skipped is None:
            return {}
        parts = [last.scale.detach().float(), self._min, self._skipped]
        if last.grad_norm is not None:
            parts.append(last.grad_norm.detach().float().to(self._min.device))
        values = torch.stack([t.to(self._min.device) for t in parts]).cpu().tolist()
        names = ["loss_scale", "loss_scale_min", "skipped_steps", "grad_norm"]
        self._last, self._min, self._skipped, self.steps = None, None, None, 0
        return {self.prefix + n: v for n, v in zip(names, values)}
