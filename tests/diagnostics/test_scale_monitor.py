"""Scale monitor: sawtooth vs collapse from real GradScaler records, overflow attribution, no syncs on clean steps."""

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import mixprec
from mixprec.diagnostics import ScaleMonitor, diagnose_scale


def _drive(pattern, *, init_scale=2.0**16, growth_interval=4, **kw):
    """Run a real GradScaler through ``pattern`` (True = this step's gradients overflow)."""
    scaler = mixprec.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval, **kw)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    for bad in pattern:
        scaler.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def test_no_overflow_and_initial_descent_are_healthy():
    assert diagnose_scale(_drive([False] * 10)).verdict == "no-overflow"
    d = diagnose_scale(_drive([True] * 3 + [False] * 10))
    assert (d.verdict, d.healthy, d.settled_scale) == ("settling", True, 2.0**13)


def test_overflows_followed_by_growth_are_a_healthy_sawtooth():
    pattern = ([False] * 4 + [True]) * 8  # grows every 4 clean steps, halves on the 5th
    d = diagnose_scale(_drive(pattern))
    assert (d.verdict, d.healthy) == ("sawtooth", True)
    assert d.growths > 0 and d.skipped == 8 and d.backoffs == 7  # the last halving shows in no recorded step


def test_repeated_halvings_without_recovery_are_collapse():
    pattern = [False] * 3 + [False, False, True] * 8  # overflow every 3rd step, growth needs 4 clean
    d = diagnose_scale(_drive(pattern))
    assert (d.verdict, d.healthy) == ("collapse", False)
    assert "without recovering" in d.message and d.final_scale == 2.0**10  # one growth, then 7 halvings seen


def test_a_streak_of_skipped_steps_after_settling_is_collapse():
    d = diagnose_scale(_drive([False] * 5 + [True] * 10))
    assert d.verdict == "collapse" and "last 10 steps were all skipped" in d.message


def test_overflows_before_any_growth_are_probing():
    d = diagnose_scale(_drive([False, False, True, False, True], growth_interval=100))
    assert (d.verdict, d.healthy) == ("probing", True)


def test_diagnose_accepts_plain_history_and_rejects_mismatched_lengths():
    assert diagnose_scale({"scale": [4.0, 4.0], "skipped": [False, False]}).verdict == "no-overflow"
    with pytest.raises(ValueError, match="2 scales but 1"):
        diagnose_scale({"scale": [4.0, 4.0], "skipped": [False]})


class ThreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, blow=False):
        h = self.l1(x)
        h = self.l2(h)
        if blow:  # the gradient overflows here and flows on to l2's and l1's parameters
            h.register_hook(lambda g: g * float("inf"))
        return self.l3(h)


class CountSyncs(TorchFunctionMode):
    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def _train(model, opt, scaler, blows, monitor=None):
    counts = []
    for blow in blows:
        loss = model(torch.ones(2, 4), blow).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        with CountSyncs() as c:
            scaler.update()
        counts.append(c.n)
        opt.zero_grad()
    return counts


def test_overflow_is_attributed_to_the_parameters_it_reached_and_clean_steps_cost_no_sync():
    torch.manual_seed(0)
    model = ThreeLayers()
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blows = [False, False, True, False]
    with ScaleMonitor(scaler, model) as mon:
        counts = _train(model, opt, scaler, blows, mon)
    assert counts[0] == counts[1] == counts[3] == 0  # clean steps: update() reads nothing
    assert counts[2] > 0  # the overflow step (already synced by step()) reads the flags
    [o] = mon.overflows()
    assert (o.step, o.scale) == (2, 2.0**8)
    assert o.params == ("l1.weight", "l1.bias", "l2.weight", "l2.bias")
    assert o.nearest_loss == "l2.bias"
    assert mon.culprits() == [("l2.bias", 1)]
    assert "update" not in vars(scaler)  # detached: the class's update again


def test_fused_optimizer_overflows_are_attributed_without_any_sync_in_the_step():
    torch.manual_seed(0)
    model = ThreeLayers()
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with ScaleMonitor(scaler, model) as mon:
        counts = _train(model, opt, scaler, [False, True, False, True])
        assert counts == [0, 0, 0, 0]  # the host never learns of a skip inside the step
        got = mon.overflows()  # one read, here
    assert [o.step for o in got] == [1, 3]
    assert all(o.nearest_loss == "l2.bias" for o in got)


def test_monitor_leaves_the_scalers_state_and_decisions_unchanged():
    def run(monitored):
        torch.manual_seed(0)
        model = ThreeLayers()
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if monitored:
            ScaleMonitor(scaler, model).attach()
        _train(model, opt, scaler, [False, True, False, False, True, False])
        return scaler.state_dict(), [p.detach().clone() for p in model.parameters()]

    (sd_a, p_a), (sd_b, p_b) = run(False), run(True)
    assert sd_a == sd_b
    assert all(torch.equal(a, b) for a, b in zip(p_a, p_b))


def test_monitor_needs_a_mixprec_scaler():
    with pytest.raises(TypeError, match="mixprec GradScaler"):
        ScaleMonitor(torch.amp.GradScaler("cpu"), nn.Linear(2, 2))


@pytest.mark.parametrize("watch", ["model", "masters"])
def test_fp16_true_overflow_is_attributed_whether_the_monitor_watches_the_model_or_its_masters(watch):
    # fp16-true keeps the 16-bit gradients on the model until their bucket's step; on a skipped
    # step (unfused optimizer) they are still there when update() runs
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision("fp16-true", "cpu", fp32_params=(), scaler={"init_scale": 2.0**8})
    model = mp.prepare(ThreeLayers())
    opt = torch.optim.SGD(mp.parameters(model), lr=0.01)
    watched = model if watch == "model" else list(mp.named_parameters(model))
    with ScaleMonitor(mp.scaler, watched) as mon:
        for blow in (False, True, False):
            with mp.autocast():
                loss = model(torch.ones(2, 4), blow).float().sum()
            mp.step(loss, opt)
    [o] = mon.overflows()
    assert o.step == 1 and o.params == ("l1.weight", "l1.bias", "l2.weight", "l2.bias")
