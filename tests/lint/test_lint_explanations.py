"""The why/fix texts of the rules are true: each number and each error they quote is measured here
with torch on CPU (the linter itself never imports torch; this test does)."""

from __future__ import annotations

import pytest

from mixprec.lint import RULES

torch = pytest.importorskip("torch")
SCALE = 2.0**16


def _scaler(**kwargs):
    return torch.amp.GradScaler("cpu", init_scale=SCALE, **kwargs)


def _quadratic(n: int, shift: float = 1.0):
    """A parameter at zero and a loss whose gradient is ``-target``: the update is readable off w."""
    w = torch.nn.Parameter(torch.zeros(n))
    target = torch.randn(n, generator=torch.Generator().manual_seed(1)) * shift
    return w, ((w - target) ** 2).sum() / 2


def _clipped_update(optimizer_class, n: int, unscale_first: bool) -> float:
    w, loss = _quadratic(n)
    opt = optimizer_class([w], lr=1.0)
    scaler = _scaler()
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([w], 1.0)
    scaler.step(opt)
    scaler.update()
    return w.detach().norm().item()


def test_mp101_clipping_scaled_gradients_shrinks_the_sgd_update_to_max_norm_over_scale():
    right = _clipped_update(torch.optim.SGD, 1000, unscale_first=True)
    wrong = _clipped_update(torch.optim.SGD, 1000, unscale_first=False)
    assert right == pytest.approx(1.0, rel=1e-5)  # clipped to max_norm 1.0
    assert wrong == pytest.approx(1.0 / SCALE, rel=1e-5)  # 1.5e-5
    why = RULES["MP101"].why
    assert "1.5e-5 instead of 1.0 at scale 2^16" in why and f"{wrong:.1e}" == "1.5e-05"


def test_mp101_adam_is_hit_less_until_its_eps_dominates():
    ratios = []
    for n in (1_000_000, 4_000_000):
        ratios.append(_clipped_update(torch.optim.Adam, n, False) / _clipped_update(torch.optim.Adam, n, True))
    assert ratios[0] == pytest.approx(0.51, abs=0.01)
    assert ratios[1] < ratios[0]  # "less in larger models"
    assert "0.51x the intended one at 1M parameters, less in larger models" in RULES["MP101"].why


def _island_weight_grad_error(backward_in_autocast: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    w = torch.randn(256, 256, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):  # an fp32 island
            y = x @ w
        loss = (y * g).sum()
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
    exact = (x.double().T @ g.double()).float()
    return ((w.grad - exact).abs().max() / exact.abs().max()).item()


def test_mp102_backward_inside_autocast_runs_an_fp32_islands_backward_in_16_bits():
    outside, inside = _island_weight_grad_error(False), _island_weight_grad_error(True)
    # fp32 accumulation over 64 terms: far below 1e-5; bf16 inputs (unit roundoff 2^-9): about 1e-3
    assert outside < 1e-5
    assert 1e-3 < inside < 1e-2
    why = RULES["MP102"].why
    assert "not recommended" in why and "backward ops run in the dtype autocast chose" in why
    assert "4e-3 instead of 3e-7" in why and f"{inside:.0e}" == "4e-03" and f"{outside:.0e}" == "3e-07"


def test_mp103_the_direct_step_texts():
    w, loss = _quadratic(4)
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    scaler.scale(loss).backward()
    opt.step()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        scaler.update()
    w = torch.nn.Parameter(torch.ones(2))
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    scaler.scale((w * torch.tensor([float("inf"), 1.0])).sum()).backward()
    scaler.unscale_(opt)
    opt.step()  # after unscale_(): applied, not skipped
    assert not torch.isfinite(w).all()
    assert "'No inf checks were recorded prior to update.'" in RULES["MP103"].why


def test_mp104_a_second_step_without_update_raises():
    w, _ = _quadratic(2)
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.scale(w.sum()).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)\."):
        scaler.step(opt)
    assert "'step() has already been called since the last update().'" in RULES["MP104"].why


def test_mp105_update_twice_raises_and_update_per_optimizer_doubles_the_next_update():
    w = torch.nn.Parameter(torch.ones(2))
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        scaler.update()
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opts, scaler = (torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)), _scaler()
    (scaler.scale(a.sum() * float("inf")) + scaler.scale(b.sum())).backward()  # b's true gradient: 1
    for opt in opts:
        scaler.step(opt)
        scaler.update()
    assert 1.0 - b.item() == 2.0  # unscaled with the halved scale: 2x the true update
    for per_optimizer, expected in ((False, 4.0), (True, 16.0)):  # 8 iterations, growth_interval 4
        a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=4)
        opts = (torch.optim.SGD([a], lr=0.0), torch.optim.SGD([b], lr=0.0))
        for _ in range(8):
            (scaler.scale(a.sum()) + scaler.scale(b.sum())).backward()
            for opt in opts:
                scaler.step(opt)
                if per_optimizer:
                    scaler.update()
            if not per_optimizer:
                scaler.update()
            a.grad = b.grad = None
        assert scaler.get_scale() == expected  # two growths instead of one: twice as often
    assert "its update is 2x the true one" in RULES["MP105"].why and "twice as often" in RULES["MP105"].why


@pytest.mark.parametrize("dtype, half_ulp_exponent", [(torch.float16, -11), (torch.bfloat16, -8)])
def test_mp106_updates_below_half_an_ulp_round_away(dtype, half_ulp_exponent):
    for weight in (1.0, 1.75):  # within [1, 2): half an ulp is 2^e, i.e. 2^(e-1) to 2^e of the weight
        w = torch.tensor(weight, dtype=dtype)
        assert w + torch.tensor(0.99 * 2.0**half_ulp_exponent, dtype=dtype) == w
        assert w + torch.tensor(1.01 * 2.0**half_ulp_exponent, dtype=dtype) != w
    e = half_ulp_exponent
    assert f"2^{e - 1} to 2^{e}" in RULES["MP106"].why


def test_mp108_fp16_cannot_hold_the_small_gradients():
    assert torch.tensor(2.9e-8).half().item() == 0.0 and torch.tensor(1e-8).half().item() == 0.0
    assert torch.tensor(2.0**-24).half().item() == 2.0**-24  # the smallest subnormal, 6.0e-8
    assert torch.finfo(torch.float16).tiny == pytest.approx(6.1e-5, rel=1e-2)
    why = RULES["MP108"].why
    assert "2^-24 (6.0e-8)" in why and "2.9e-8 and 1e-8 become 0" in why and "6.1e-5" in why


def test_mp109_a_forward_after_a_step_in_the_same_region_uses_the_stale_cached_weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = lin(x)
        before.float().sum().backward()
        opt.step()
        after = lin(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = lin(x)
    assert torch.equal(after, before)  # the cached bf16 copy of the old weight
    assert not torch.equal(fresh, before)
    assert "returns exactly what it returned before it" in RULES["MP109"].why


def test_mp110_eps_in_fp16_and_cpu_autocast_log_exp():
    assert torch.tensor(1e-8).half().item() == 0.0
    x = torch.rand(4, dtype=torch.bfloat16) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.log(x).dtype == torch.exp(x).dtype == torch.bfloat16
    assert "an eps of 1e-8 is 0 in fp16" in RULES["MP110"].why and "on CPU log and exp" in RULES["MP110"].why


def test_mp111_a_resume_without_the_scaler_state_skips_steps_again():
    def run(scaler, steps):
        w = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([w], lr=0.1)
        taken = []
        for _ in range(steps):
            scaler.scale(w.sum()).backward()
            if scaler.get_scale() > 2.0**10:  # gradients that overflow above scale 2^10
                w.grad.fill_(float("inf"))
            before = w.item()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            taken.append(w.item() != before)
        return taken

    first = _scaler()
    assert run(first, 8) == [False] * 6 + [True] * 2  # backs off 2^16 -> 2^10
    restored = _scaler()
    restored.load_state_dict(first.state_dict())
    assert all(run(restored, 4))
    assert run(_scaler(), 8) == [False] * 6 + [True] * 2  # resumed without it: 6 steps skipped again
    assert "backed off to 2^10 skips 6 steps" in RULES["MP111"].why


def test_mp112_an_unscaled_backward_then_scaler_step():
    updates = {}
    for name, make in (("SGD", torch.optim.SGD), ("Adam", torch.optim.Adam)):
        for scaled in (True, False):
            w, loss = _quadratic(1000, shift=1e-3)
            opt, scaler = make([w], lr=1.0), _scaler()
            scaled_loss = scaler.scale(loss)
            (scaled_loss if scaled else loss).backward()
            scaler.step(opt)
            scaler.update()
            updates[name, scaled] = w.detach().norm().item()
    assert updates["SGD", False] / updates["SGD", True] == pytest.approx(1 / SCALE, rel=1e-4)  # 1.5e-5
    assert updates["Adam", False] / updates["Adam", True] == pytest.approx(0.52, abs=0.01)
    w, loss = _quadratic(4)
    loss.backward()
    with pytest.raises(AssertionError, match="_scale is None"):
        _scaler().step(torch.optim.SGD([w], lr=0.1))
    why = RULES["MP112"].why
    assert "1.5e-5x" in why and "0.52x at 1000 parameters" in why and "AssertionError" in why


def test_mp113_a_second_step_after_a_skipped_one_writes_inf():
    w = torch.nn.Parameter(torch.ones(2))
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    scaler.scale((w * torch.tensor([float("inf"), 1.0])).sum()).backward()
    scaler.step(opt)  # skipped
    assert torch.isfinite(w).all()
    opt.step()
    assert not torch.isfinite(w).all()
    assert "writing inf/NaN into the weights" in RULES["MP113"].why


def test_mp114_unscale_on_every_micro_batch_raises_on_the_second():
    w, _ = _quadratic(4)
    opt, scaler = torch.optim.SGD([w], lr=0.1), _scaler()
    message = "unscale_() has already been called on this optimizer since the last update()."
    scaler.scale((w * w).sum()).backward()
    scaler.unscale_(opt)  # micro-batch 0
    scaler.scale((w * w).sum()).backward()
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scaler.unscale_(opt)  # micro-batch 1, before the boundary's step() and update()
    assert message.rstrip(".") in RULES["MP114"].why
    off = torch.amp.GradScaler("cpu", enabled=False)  # why a disabled scaler is left out
    off.unscale_(opt)
    off.unscale_(opt)


def test_mp115_losses_never_run_in_16_bits_under_autocast():
    f = torch.nn.functional
    x, y = torch.randn(4, 8, dtype=torch.bfloat16), torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f.cross_entropy(x, y).dtype == torch.float32
        assert f.mse_loss(x, x).dtype == torch.float32
        assert f.cross_entropy(x.float(), y).dtype == torch.float32  # fp32 inputs from an fp32 forward
    assert "only the loss, which autocast never runs in 16 bits" in RULES["MP115"].why


def test_mp201_the_old_api_warns():
    with pytest.warns(FutureWarning, match="is deprecated"):
        torch.cuda.amp.GradScaler(enabled=False)
    assert "FutureWarning" in RULES["MP201"].why
