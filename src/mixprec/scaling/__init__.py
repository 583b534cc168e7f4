"""Loss scalers: a drop-in ``GradScaler`` and its static and no-op siblings.

``GradScaler`` accepts ``torch.amp.GradScaler``'s constructor, methods, state machine and errors
unchanged, and with default arguments produces the same scales, skip decisions and parameters
(tests/test_scaling_differential.py checks this over thousands of random steps). On top:

- ``hysteresis`` / ``consecutive_hysteresis``: DeepSpeed's rule (an overflow lowers the scale only
  after ``hysteresis`` overflows; the counter refills on growth, or on every clean step when
  consecutive).
- ``min_scale`` / ``max_scale`` and ``on_floor`` ("raise", "warn" or "skip"): torch's scale can
  collapse toward 0 silently (pytorch#99640); here it stops at the floor and you choose what happens.
- fp16 gradients are unscaled instead of refused (``allow_fp16_grads``), see the caveat there.
- A per-step record (scale used, skipped) kept as device tensors: recording costs no host sync.
  ``last_skipped`` is a 0-d device tensor; ``was_skipped()`` gives a bool.

Where host syncs remain: an unfused optimizer's ``step`` reads found_inf with ``.item()`` to decide
whether to call ``optimizer.step()`` (one sync per optimizer per step, as in torch). Fused
optimizers (``Adam/AdamW/Adagrad/SGD(fused=True)``) receive ``grad_scale`` / ``found_inf`` tensors and
skip on the device: ``scale``/``unscale_``/``step``/``update`` then never sync. Exception: fused SGD
with momentum leaves its momentum buffer uninitialised when its first step is skipped (a torch
bug; see ``stages._fused_skip_unsafe``), so it takes the unfused, syncing path here. ``get_scale()``,
``state_dict()``, ``was_skipped()`` and ``history()`` read device values and so sync when called.
With a fused optimizer, ``on_floor="raise"/"warn"`` is checked at those reads (``check_floor()``);
with an unfused one it is checked in ``update()`` on overflow steps only.

The modules, one seam each (``GradScaler`` is one class; the seams are its mixins):

- ``scaler``: ``GradScaler`` itself: its state, ``scale``, ``update``, getters, ``state_dict``, pickling.
- ``stages``: the per-optimizer state machine (READY -> UNSCALED -> STEPPED): ``unscale_``,
  ``unscale_deferred_``, ``share_skip_decision``, ``step`` and the fused step.
- ``bounds``: hysteresis, ``min_scale`` / ``max_scale``, ``on_floor`` / ``check_floor`` and the
  power-of-two bookkeeping.
- ``record``: the per-step record: ``last_skipped``, ``last_scale``, ``was_skipped()``,
  ``skipped_steps``, ``history()``.
- ``static``: ``StaticLossScaler`` and ``NoOpScaler``; ``choose``: which one a recipe trains with.
- ``errors``: ``ScaleFloorError``, ``ScalerConfigError``.
"""

from mixprec.scaling.bounds import OnFloor
from mixprec.scaling.errors import ScaleFloorError, ScalerConfigError
from mixprec.scaling.scaler import GradScaler
from mixprec.scaling.static import NoOpScaler, StaticLossScaler

__all__ = ["GradScaler", "NoOpScaler", "OnFloor", "ScaleFloorError", "ScalerConfigError", "StaticLossScaler"]
