"""Step records as TensorBoard scalars (``torch.utils.tensorboard``), written in batches.

    from mixprec.integrations.tensorboard import TensorBoardStepWriter

    with TensorBoardStepWriter("runs/fp16", every=50) as tb:
        for x, y in batches:
            ...
            tb.log(mp.step(loss, opt))       # no host sync; every 50 steps one read-back and a write

Tags: ``mixprec/loss``, ``mixprec/loss_scale`` (the sawtooth of a dynamic scaler),
``mixprec/skipped`` (1 at each skipped step) and ``mixprec/grad_norm`` (when measured), each at
the optimizer step's number. Needs the ``tensorboard`` package (``pip install "mixprec[tensorboard]"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mixprec.integrations.records import StepLog
from mixprec.training import StepStats


def _summary_writer(log_dir: str | Path | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch.utils.tensorboard needs the tensorboard package
        raise ImportError(
            f"TensorBoardStepWriter writes with torch.utils.tensorboard, which needs the tensorboard package "
            f"({e}). Install it: pip install \"mixprec[tensorboard]\"."
        ) from None
    return SummaryWriter(log_dir=None if log_dir is None else str(log_dir))


def write_records(writer: Any, records: Iterable[tuple[int, dict[str, float]]]) -> int:
    """Write ``StepLog`` records to a ``SummaryWriter`` (or anything with ``add_scalar(tag, value,
    global_step)``); returns how many scalars were written."""
    n = 0
    for step, metrics in records:
        for tag, value in metrics.items():
            writer.add_scalar(tag, value, global_step=step)
            n += 1
    return n


class TensorBoardStepWriter:
    """``StepStats`` of each step -> TensorBoard, read back and written ``every`` steps.

    Args:
        log_dir: a directory (a ``SummaryWriter`` is made there and closed by ``close``), or a
            ``SummaryWriter`` of yours (left open), or None for TensorBoard's default ``runs/...``.
        every: steps per read-back (one host transfer for all of them).
        prefix: the tags' prefix.
    """

    def __init__(self, log_dir: Any = None, every: int = 50, prefix: str = "mixprec/") -> None:
        self.records = StepLog(every=every, prefix=prefix)
        if hasattr(log_dir, "add_scalar"):
            self.writer, self._owns = log_dir, False
        else:
            self.writer, self._owns = _summary_writer(log_dir), True

    def log(self, stats: StepStats) -> None:
        """Keep this step's record; write the batch when ``every`` steps have gathered."""
        write_records(self.writer, self.records.append(stats))

    def flush(self) -> None:
        """Write what is buffered now (one read-back) and flush the event file."""
        write_records(self.writer, self.records.flush())
        self.writer.flush()

    def close(self) -> None:
        self.flush()
        if self._owns:
            self.writer.close()

    def __enter__(self) -> TensorBoardStepWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
