"""Progress of a comparison on the terminal: one bar per run, with the latest loss."""

from __future__ import annotations

from typing import Any


class RichProgress:
    """A rich progress display; pass ``on_run`` and ``on_step`` to ``compare``. Use as a context manager.

    The loss shown is read from the device every ``loss_every`` steps only (a read is a host sync
    on CUDA).
    """

    def __init__(self, console: Any = None, loss_every: int = 10) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.loss_every = loss_every
        self._progress = Progress(
            TextColumn("[bold]{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> RichProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)  # type: ignore[arg-type]

    def on_run(self, label: str, index: int, total: int) -> None:
        self._tasks[label] = self._progress.add_task(f"{index + 1}/{total} {label}", total=None, loss="-")

    def on_step(self, label: str, done: int, total: int, loss: Any) -> None:
        task_id = self._tasks.get(label)
        if task_id is None:
            task_id = self._tasks[label] = self._progress.add_task(label, total=total, loss="-")
        fields: dict[str, Any] = {}
        if done % self.loss_every == 0 or done == total:
            fields["loss"] = f"{float(loss):.5g}"
        self._progress.update(task_id, completed=done, total=total, **fields)
