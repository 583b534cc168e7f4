"""StepLog (batched read-back of step records) and TensorBoardStepWriter (event files read back)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from integ_helpers import batches, make_data, make_net, make_optimizer
from mixprec import MixedPrecision
from mixprec.integrations.records import StepLog, StepWindow


def train(recipe="fp16-mixed", sink=None, steps=30, **mp_kwargs):
    """30 fp16 steps with a scale that grows every 3 steps and two injected overflows."""
    mp = MixedPrecision(recipe, "cpu", scaler={"growth_interval": 3}, **mp_kwargs)
    model = mp.prepare(make_net())
    opt = make_optimizer(mp.parameters(model))
    stats = []
    for i, (x, y) in enumerate(batches(*make_data(overflow_at=(4, 17)))):
        if i == steps:
            break
        with mp.autocast():
            loss = F.mse_loss(model(x), y)
        s = mp.step(loss, opt, max_grad_norm=1.0 if i % 2 else None)
        stats.append(s)
        if sink is not None:
            sink(s)
    return stats


def test_steplog_reads_back_every_n_steps_in_one_batch():
    log = StepLog(every=8)
    got = []
    stats = train(sink=lambda s: got.extend(log.append(s)))
    assert len(got) == 24 and len(log) == 6  # three batches of 8 handed back, 6 still on the device
    got += log.flush()
    assert len(log) == 0 and log.flush() == []
    want = [s.to_dict() for s in stats]
    assert [step for step, _ in got] == [w["step"] for w in want] == list(range(1, 31))
    metrics = [m for _, m in got]
    assert [m["mixprec/loss_scale"] for m in metrics] == [w["scale"] for w in want]
    assert [m["mixprec/skipped"] for m in metrics] == [float(w["skipped"]) for w in want]
    assert [repr(m["mixprec/loss"]) for m in metrics] == [repr(w["loss"]) for w in want]
    # the norm where the step measured it (clipping every other step), absent elsewhere
    assert [repr(m.get("mixprec/grad_norm")) for m in metrics][1::2] == [repr(w["grad_norm"]) for w in want][1::2]
    assert all("mixprec/grad_norm" not in m for m in metrics[0::2])
    assert metrics[4]["mixprec/skipped"] == 1.0 and metrics[17]["mixprec/skipped"] == 1.0
    scales = [m["mixprec/loss_scale"] for m in metrics]
    moves = [b / a for a, b in zip(scales, scales[1:]) if a != b]
    assert moves.count(2.0) >= 3 and moves.count(0.5) >= 3  # the sawtooth: grown, halved, grown again


def test_steplog_no_sync_until_flush(monkeypatch):
    """Appending reads nothing back: Tensor.item/tolist/__float__ are not called until the batch is full."""
    stats = train(steps=6)
    log = StepLog(every=100)
    calls = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    for s in stats:
        assert log.append(s) == []
    assert calls == []
    log.flush()
    assert calls == ["tolist"]


def test_step_window_summarizes_the_steps_since_the_last_read():
    window = StepWindow()
    stats = train(steps=12, sink=window.append)
    first = window.read()
    scales = [float(s.scale) for s in stats]
    assert first["mixprec/loss_scale"] == scales[-1] and first["mixprec/loss_scale_min"] == min(scales)
    assert first["mixprec/skipped_steps"] == sum(float(s.skipped) for s in stats) >= 1.0  # the overflow at step 5
    assert first["mixprec/grad_norm"] == float(stats[-1].grad_norm)  # step 12 clipped
    assert window.read() == {} and window.steps == 0  # a new window


def test_steplog_refuses_bad_input():
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        StepLog(every=0)
    with pytest.raises(TypeError, match="expects the StepStats that mp.step returns"):
        StepLog().append({"loss": 1.0})


def test_micro_steps_are_not_recorded():
    mp = MixedPrecision("bf16-mixed", "cpu", accumulate=2)
    model = mp.prepare(make_net())
    opt = make_optimizer(mp.parameters(model))
    log = StepLog(every=100)
    for x, y in list(batches(*make_data()))[:6]:
        with mp.autocast():
            loss = F.mse_loss(model(x), y)
        log.append(mp.step(loss, opt))
    assert [step for step, _ in log.flush()] == [1, 2, 3]


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mixprec.integrations.tensorboard import TensorBoardStepWriter

    with TensorBoardStepWriter(tmp_path / "run", every=7) as tb:
        stats = train(sink=tb.log)
        assert len(tb.records) == 30 % 7  # written in batches of 7; the rest at close
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"mixprec/loss", "mixprec/loss_scale", "mixprec/skipped", "mixprec/grad_norm"} <= tags
    scale = events.Scalars("mixprec/loss_scale")
    assert [e.step for e in scale] == list(range(1, 31))
    assert [e.value for e in scale] == [float(s.scale) for s in stats]
    skipped = [e.step for e in events.Scalars("mixprec/skipped") if e.value == 1.0]
    assert skipped == [s.step for s in stats if bool(s.skipped)] and {5, 18} <= set(skipped)
    assert len(events.Scalars("mixprec/grad_norm")) == 15


def test_tensorboard_writer_takes_your_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from mixprec.integrations.tensorboard import TensorBoardStepWriter

    writer = SummaryWriter(tmp_path)
    tb = TensorBoardStepWriter(writer, every=100)
    for s in train(steps=3):
        tb.log(s)
    tb.close()  # flushes, and leaves your writer open
    writer.add_scalar("after", 1.0, 0)
    writer.close()
