"""The per-step record: which scale each step used and whether it was skipped, kept on the device.

Holds ``_StepRecord``, the ``GradScaler`` mixin that reads it: ``last_skipped`` / ``last_scale``
(0-d device tensors, no sync), ``was_skipped()``, ``skipped_steps`` and ``history()``. The record is
written by ``GradScaler.update()`` (``mixprec.scaling.scaler``: ``_write_record``, also for
``update(new_scale)`` after a step) and its attributes are set by ``GradScaler.__init__``:
``_last_found_inf`` (the summed found_inf; ``_last_found``, the flag, is formed from it when read),
``_last_scale``, ``_last_host_skipped``, the ``_record`` deque of ``(update index, scale used, found
inf sum)``, ``_updates``, the device counter ``_skipped_total`` and the sums not yet counted into it
(``_unfolded``).
Also relies on ``_enabled``, and ``was_skipped()`` calls ``check_floor()`` (``mixprec.scaling.bounds``).
"""

from __future__ import annotations

import torch


class _StepRecord:
    """Reading the per-step record (see the module docstring)."""

    @property
    def last_skipped(self) -> torch.Tensor | None:
        """0-d bool device tensor: did the last ``update()``'s step overflow (and so skip)? No sync."""
        if self._last_found is None and self._last_found_inf is not None:
            self._last_found = self._last_found_inf > 0
        return self._last_found

    def _fold_skipped(self) -> torch.Tensor | None:
        """Count the steps recorded since the last fold into ``_skipped_total`` (on the device)."""
        if self._unfolded and self._skipped_total is not None:
            self._skipped_total.add_((torch.stack(self._unfolded) > 0).sum())
            self._unfolded = []
        return self._skipped_total

    @property
    def last_scale(self) -> torch.Tensor | None:
        """0-d device tensor: the scale the last ``update()``'s step was taken (or skipped) with."""
        return self._last_scale

    def was_skipped(self) -> bool:
        """Whether the last step was skipped. Free after an unfused step; otherwise one sync."""
        if self._last_host_skipped is not None:
            return self._last_host_skipped
        found = self.last_skipped
        if found is None:
            return False
        self.check_floor()
        return bool(found.item())

    @property
    def skipped_steps(self) -> torch.Tensor | None:
        """Total skipped steps as a 0-d device tensor (no sync); None when disabled. Before the
        first ``scale()`` (a fresh, loaded or unpickled scaler) a CPU tensor of the count so far."""
        if not self._enabled:
            return None
        total = self._fold_skipped()
        return torch.tensor(self._init_skipped, dtype=torch.int64) if total is None else total

    def history(self) -> dict[str, torch.Tensor]:
        """The last ``record_steps`` steps as CPU tensors: ``step``, ``scale`` (used), ``skipped``.

        One sync for all of them.
        """
        if not self._enabled or not self._record:
            return {
                "step": torch.zeros(0, dtype=torch.int64),
                "scale": torch.zeros(0),
                "skipped": torch.zeros(0, dtype=torch.bool),
            }
        steps, scales, found = zip(*self._record)
        # (after unpickling, the steps recorded before are CPU tensors and the later ones on the device)
        dev = scales[-1].device
        return {
            "step": torch.tensor(steps, dtype=torch.int64),
            "scale": torch.stack([t.to(dev, non_blocking=True) for t in scales]).cpu(),
            "skipped": (torch.stack([t.to(dev, non_blocking=True) for t in found]) > 0).cpu(),
        }
