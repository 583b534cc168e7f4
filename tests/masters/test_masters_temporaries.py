"""The memory the master-weight step allocates beyond its step-time fp32 values and gradients.

``MasterWeights.temp_bytes`` (per element of one bucket) feeds the memory plan's peak; here it is
checked against the allocations the step really makes, counted through the dispatcher: every new
tensor storage an op creates, until it is freed (views and in-place ops allocate nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.masters import STRATEGIES
from mixprec.instruments.storage import LiveBytes


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true", "bf16-true-kahan", "bf16-true-sr",
                                    "bf16-true-remainder", "bf16-pure"])
def test_declared_step_temporaries_match_what_the_step_allocates(recipe, monkeypatch):
    n = 128 * 128  # per layer; four layers, one bucket each
    monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", n)
    mp = MixedPrecision(recipe, "cpu", fp32_params=())
    model = mp.prepare(nn.Sequential(*(nn.Linear(128, 128, bias=False) for _ in range(4))))
    assert len(mp.masters.buckets) == 4
    opt = torch.optim.SGD(mp.parameters(model), lr=1e-3)  # stateless: only the strategy allocates
    peaks: dict[str, list[float]] = {}
    for phase in ("after_backward", "_step_bucket", "after_step"):
        inner = getattr(mp.masters, phase)

        def measured(*args, _inner=inner, _phase=phase, **kwargs):
            with LiveBytes() as live:
                out = _inner(*args, **kwargs)
            peaks.setdefault(_phase, []).append(live.peak / n)
            return out

        setattr(mp.masters, phase, measured)
    with mp.autocast():
        loss = model(torch.randn(4, 128)).float().pow(2).mean()
    mp.step(loss, opt)
    strategy = STRATEGIES[mp.recipe.master]
    # the step runs one bucket at a time, fp16-true's loss scaler included (it checks the 16-bit
    # gradients where they wait)
    assert len(peaks.get("_step_bucket", [])) == 4, peaks
    # the 16-bit gradients wait on the model, nothing is made after backward; per bucket: its
    # fp32 gradients and rebuilt values (none for fp32 masters), the temporaries, freed before the next
    assert peaks["after_backward"] == [0.0] and mp.masters.deferred is False  # (reset by after_step)
    measured_temp = [p - strategy.step_bytes - strategy.value_bytes for p in peaks["_step_bucket"]]
    measured_temp += peaks["after_step"]
    assert strategy.temp_bytes - 2 <= max(measured_temp) <= strategy.temp_bytes, peaks
