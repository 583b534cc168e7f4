"""The seam the integrations stand on (no framework needed): MixedPrecision.step run in its public
parts, as a framework that owns backward and optimizer.step runs it, gives mp.step's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from integ_helpers import batches, bitwise, hand_loop, make_data, make_net, make_optimizer, make_scheduler, params_equal
from mixprec import MixedPrecision


def in_parts(recipe: str, x, y, *, accumulate: int = 1, max_grad_norm: float | None = None):
    """backward of mp.scaler.scale(loss / accumulate), after_backward; at the boundary unscale_,
    clip_grad_norm_, optimizer_step: a framework's loop with its own accumulation."""
    mp = MixedPrecision(recipe, "cpu")
    model = mp.prepare(make_net())
    opt = make_optimizer(mp.parameters(model))
    sched = make_scheduler(opt)
    out, window = [], None
    for i, (xb, yb) in enumerate(batches(x, y)):
        with mp.autocast():
            loss = F.mse_loss(model(xb), yb) / accumulate
        mp.scaler.scale(loss).backward()
        window = loss.detach() if window is None else window + loss.detach()
        boundary = (i + 1) % accumulate == 0
        mp.after_backward(opt, boundary=boundary)
        if boundary:
            mp.unscale_(opt)
            norm = mp.clip_grad_norm_(opt, max_grad_norm)
            out.append(mp.optimizer_step(opt, scheduler=sched, loss=window, grad_norm=norm).to_dict())
            window = None
    return model, out, sched


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true", "bf16-true-kahan", "fp16-true"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_parts_are_mp_step_bitwise(recipe, accumulate):
    data = make_data(overflow_at=(4,))
    model, steps, sched = in_parts(recipe, *data, accumulate=accumulate, max_grad_norm=0.5)
    ref, ref_steps, ref_sched = hand_loop(recipe, *data, accumulate=accumulate, max_grad_norm=0.5)
    assert params_equal(model, ref)
    keys = ("scale", "skipped", "step")
    assert [[s[k] for k in keys] for s in steps] == [[s[k] for k in keys] for s in ref_steps]
    assert bitwise(torch.tensor([s["loss"] for s in steps]), torch.tensor([s["loss"] for s in ref_steps]))
    assert bitwise(torch.tensor([s["grad_norm"] for s in steps]), torch.tensor([s["grad_norm"] for s in ref_steps]))
    assert sched.last_epoch == ref_sched.last_epoch
    if recipe.startswith("fp16"):
        assert any(s["skipped"] for s in steps)


def test_clip_grad_norm_without_a_norm_measures_only_when_tracking():
    mp = MixedPrecision("bf16-mixed", "cpu")
    model = mp.prepare(make_net())
    opt = make_optimizer(mp.parameters(model))
    x, y = make_data()
    F.mse_loss(model(x[:8]), y[:8]).backward()
    mp.unscale_(opt)
    assert mp.clip_grad_norm_(opt, None) is None
    mp.track_grad_norm = True
    assert float(mp.clip_grad_norm_(opt, None)) > 0
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        mp.clip_grad_norm_(opt, 0.0)
    stats = mp.optimizer_step(opt)
    assert stats.stepped and stats.step == 1 and torch.isnan(stats.loss)  # no loss given: NaN in the record
