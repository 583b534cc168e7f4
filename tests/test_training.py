"""MixedPrecision: the order of a step, accumulation, several optimizers, skips, resume, misuse."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.islands import island_names

RECIPES = ["fp32", "bf16-mixed", "fp16-mixed"]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _batches(n: int, seed: int = 1, learnable: bool = False):
    """n batches of 16; labels random, or (learnable) set by a fixed linear teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g)
        y = (x @ teacher).argmax(-1) if learnable else torch.randint(0, 4, (16,), generator=g)
        out.append((x, y))
    return out


def _train(mp, model, opt, batches, **step_kw):
    stats = []
    for x, y in batches:
        with mp.autocast():
            out = model(x)
        stats.append(mp.step(F.cross_entropy(out, y), opt, **step_kw))
    return stats


# ---------------------------------------------------------------- the contract in the issue


@pytest.mark.parametrize("recipe", ["auto", *RECIPES, "p=f32,c=bf16,o=f32", "params=float32,compute=float16,output=float32"])
def test_issue_example_loop_runs_for_every_recipe_and_returns_tensor_stats(recipe):
    mp = mixprec.MixedPrecision(recipe, device="cpu")
    model = mp.prepare(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stats = _train(mp, model, opt, _batches(5), max_grad_norm=1.0)
    last = stats[-1]
    assert isinstance(last.loss, torch.Tensor) and last.loss.dtype == torch.float32
    assert isinstance(last.grad_norm, torch.Tensor) and isinstance(last.skipped, torch.Tensor)
    assert last.stepped and last.step == 5
    d = last.to_dict()
    assert set(d) == {"loss", "grad_norm", "scale", "skipped", "stepped", "step"}


def test_prepared_model_outputs_fp32_and_runs_matmuls_in_the_compute_dtype():
    mp = mixprec.MixedPrecision("bf16-mixed", device="cpu")
    model = mp.prepare(_mlp())
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.update(linear=o.dtype))
    with mp.autocast():
        out = model(torch.randn(2, 8))
    assert seen["linear"] == torch.bfloat16
    assert out.dtype == torch.float32  # output cast: the loss is computed in fp32


def test_grad_norm_is_of_unscaled_gradients_so_clipping_is_real():
    """The seeds' trap: clipping before unscale_ clips against a norm S times too large."""
    ref_model = _mlp()
    x, y = _batches(1)[0]
    F.cross_entropy(ref_model(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])

    # an fp32 recipe with a real scaler, so the scale is large while the math stays exact
    recipe = mixprec.Recipe("fp32-scaled", mixprec.get_policy("f32"), loss_scaling="dynamic")
    mp = mixprec.MixedPrecision(recipe, device="cpu", scaler={"init_scale": 2.0**16})
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = mp.step(F.cross_entropy(model(x), y), opt, max_grad_norm=1e-3)
    assert float(stats.scale) == 2.0**16
    torch.testing.assert_close(stats.grad_norm, true_norm, rtol=1e-5, atol=0)


def test_clipping_limits_the_applied_update():
    x, y = _batches(1)[0]
    updates = {}
    for clip in (None, 1e-3):
        mp = mixprec.MixedPrecision("fp16-mixed", device="cpu")
        model = mp.prepare(_mlp())
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with mp.autocast():
            out = model(x)
        mp.step(F.cross_entropy(out, y), opt, max_grad_norm=clip)
        with torch.no_grad():
            updates[clip] = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert float(updates[1e-3]) == pytest.approx(1e-3, rel=1e-2)  # lr 1 * clipped norm
    assert float(updates[None]) > 100 * float(updates[1e-3])


def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged_and_scheduler_waits():
    for fused in (False, True):
        mp = mixprec.MixedPrecision("fp16-mixed", device="cpu")
        model = mp.prepare(_mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        batches = _batches(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
            _train(mp, model, opt, batches[:2], scheduler=sched)
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        lr = opt.param_groups[0]["lr"]
        handle = model[3].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        (stats,) = _train(mp, model, opt, batches[2:], scheduler=sched)
        handle.remove()
        assert bool(stats.skipped) and mp.scaler.was_skipped()
        for p, b in zip(model.parameters(), params):
            assert torch.equal(p, b)
        for k, v in opt.state_dict()["state"].items():
            for f, t in v.items():
                assert torch.equal(t, state["state"][k][f]), (fused, k, f)
        assert opt.param_groups[0]["lr"] == lr  # the scheduler was not stepped on the skip
        assert float(stats.scale) == 2.0**16 and mp.scaler.get_scale() == 2.0**15


def test_several_optimizers_share_one_skip_decision():
    mp = mixprec.MixedPrecision("fp16-mixed", device="cpu")
    model = mp.prepare(_mlp())
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.AdamW([*model[1].parameters(), *model[3].parameters()], lr=0.1)
    params = [p.detach().clone() for p in model.parameters()]
    handle = model[3].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
    x, y = _batches(1)[0]
    with mp.autocast():
        out = model(x)
    stats = mp.step(F.cross_entropy(out, y), [opt_a, opt_b], max_grad_norm=1.0)
    handle.remove()
    assert bool(stats.skipped)
    for p, b in zip(model.parameters(), params):
        assert torch.equal(p, b)  # opt_a's grads were finite, yet it skipped too
    stats = _train(mp, model, [opt_a, opt_b], _batches(1, seed=5))
    assert not bool(stats[0].skipped)
    assert not torch.equal(model[0].weight, params[0])


def test_accumulation_equals_one_big_batch():
    big = _batches(4)
    x = torch.cat([b[0] for b in big])
    y = torch.cat([b[1] for b in big])
    ref = _mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    F.cross_entropy(ref(x), y).backward()
    opt_ref.step()

    mp = mixprec.MixedPrecision("fp32", device="cpu", accumulate=4)
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = _train(mp, model, opt, big)
    assert [s.stepped for s in stats] == [False, False, False, True]
    assert [s.step for s in stats] == [0, 0, 0, 1]
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    # the window's loss is the big batch's loss (equal-sized micro-batches)
    assert float(stats[-1].loss) == pytest.approx(F.cross_entropy(_mlp()(x), y).item(), rel=1e-5)


def test_accumulation_window_loss_is_the_mean_of_micro_losses():
    mp = mixprec.MixedPrecision("fp32", device="cpu", accumulate=2)
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x1, y1 = _batches(2)[0]
    x2, y2 = _batches(2)[1]
    l1 = F.cross_entropy(model(x1), y1)
    s1 = mp.step(l1, opt)
    l2 = F.cross_entropy(model(x2), y2)
    s2 = mp.step(l2, opt)
    assert float(s1.loss) == pytest.approx(l1.item())
    assert float(s2.loss) == pytest.approx((l1.item() + l2.item()) / 2, rel=1e-6)


# ---------------------------------------------------------------- numerics against fp32


@pytest.mark.parametrize("recipe,tol", [("bf16-mixed", 0.01), ("fp16-mixed", 0.002)])
def test_mixed_recipes_track_fp32_on_a_small_model(recipe, tol):
    """Loose but real: after 40 steps the 16-bit run's loss is within tol (relative) of fp32's,
    and the loss fell by more than 20x that tolerance, so tracking is not trivially satisfied."""
    batches = _batches(8, learnable=True)
    curves = {}
    for r in ("fp32", recipe):
        mp = mixprec.MixedPrecision(r, device="cpu")
        model = mp.prepare(_mlp(3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stats = _train(mp, model, opt, batches * 5, max_grad_norm=1.0)
        curves[r] = torch.stack([s.loss for s in stats])
    ref, got = curves["fp32"], curves[recipe]
    assert torch.isfinite(got).all()
    assert ref[-8:].mean() < 0.5 * ref[:8].mean()
    rel = ((got[-8:].mean() - ref[-8:].mean()).abs() / ref[-8:].mean()).item()
    assert rel < tol, rel
    assert (ref[:8].mean() - ref[-8:].mean()) / ref[-8:].mean() > 20 * tol


class _SeedMLP(nn.Module):
    """The seeds' two-layer model: y = relu(x @ w1.T) @ w2.T, weights as raw fp32 parameters."""

    def __init__(self, d_in: int, d_hidden: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(d_hidden, d_in, generator=g) * 0.02)
        self.w2 = nn.Parameter(torch.randn(d_in, d_hidden, generator=g) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1.t()) @ self.w2.t()


def test_seed_hand_written_fp16_loop_and_fp16_mixed_skip_and_halve_at_the_same_steps():
    """The seeds' verification: their manual fp16 loop (fp32 masters, fp16 compute copies, scaled
    backward, inf check, unscale, conditional step, grow/backoff) against MixedPrecision."""
    d_in, d_hidden, steps, interval = 32, 64, 120, 10
    init_scale = 2.0**40  # far above what fp16 gradients fit: the scaler must back off and probe
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, d_in, generator=g) * 4, torch.randn(8, d_in, generator=g)) for _ in range(steps)]

    # --- the seed's loop, verbatim in spirit (smaller shapes for a CPU)
    hand = _SeedMLP(d_in, d_hidden, seed=1)
    w1, w2 = hand.w1, hand.w2
    opt = torch.optim.AdamW([w1, w2], lr=3e-3)
    scale, good_steps = init_scale, 0
    hand_losses, hand_skips = [], []
    for x, y in data:
        h = torch.relu(x.half() @ w1.half().t())
        pred = h @ w2.half().t()
        loss = (pred.float() - y).pow(2).mean()
        (loss * scale).backward()
        with torch.no_grad():
            grads = [w1.grad, w2.grad]
            if any(not gr.isfinite().all() for gr in grads):
                scale, good_steps = scale * 0.5, 0
                hand_skips.append(True)
            else:
                for gr in grads:
                    gr.div_(scale)
                opt.step()
                good_steps += 1
                if good_steps == interval:
                    scale, good_steps = scale * 2.0, 0
                hand_skips.append(False)
        opt.zero_grad(set_to_none=True)
        hand_losses.append(loss.item())

    # --- the same with mixprec
    mp = mixprec.MixedPrecision("fp16-mixed", device="cpu", scaler={"init_scale": init_scale, "growth_interval": interval})
    model = mp.prepare(_SeedMLP(d_in, d_hidden, seed=1))
    opt2 = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mp_losses, mp_skips = [], []
    for x, y in data:
        with mp.autocast():
            pred = model(x)
        stats = mp.step((pred - y).pow(2).mean(), opt2)
        mp_losses.append(float(stats.loss))
        mp_skips.append(bool(stats.skipped))

    assert sum(hand_skips) >= 10, "the run must overflow and back off repeatedly to prove anything"
    assert any(not s for s in hand_skips[:30]) and sum(hand_skips[60:]) >= 2, "a sawtooth, not only the initial descent"
    assert mp_skips == hand_skips
    assert mp.scaler.get_scale() == scale
    early = torch.tensor(hand_losses[:40]), torch.tensor(mp_losses[:40])
    torch.testing.assert_close(early[1], early[0], rtol=1e-3, atol=0)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_from_checkpoint_continues_bit_for_bit(recipe):
    batches = _batches(12)
    kw = {"scaler": {"init_scale": 2.0**20, "growth_interval": 3}} if recipe == "fp16-mixed" else {}

    def fresh():
        mp = mixprec.MixedPrecision(recipe, device="cpu", **kw)
        model = mp.prepare(_mlp(7))
        return mp, model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    mp, model, opt = fresh()
    straight = _train(mp, model, opt, batches, max_grad_norm=1.0)

    mp, model, opt = fresh()
    _train(mp, model, opt, batches[:5], max_grad_norm=1.0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    mp2, model2, opt2 = fresh()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    mp2.load_state_dict(ckpt["mp"])
    resumed = _train(mp2, model2, opt2, batches[5:], max_grad_norm=1.0)

    for a, b in zip(straight[5:], resumed):
        assert torch.equal(a.loss, b.loss) and torch.equal(a.scale, b.scale) and torch.equal(a.skipped, b.skipped)
    assert resumed[-1].step == straight[-1].step == 12
    if recipe == "fp16-mixed":
        assert any(bool(s.skipped) for s in straight), "the fp16 run should have exercised skips"


def test_state_dict_refuses_mid_accumulation_and_load_checks_recipe():
    mp = mixprec.MixedPrecision("fp32", device="cpu", accumulate=2)
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(mp, model, opt, _batches(1))
    with pytest.raises(RuntimeError, match="middle of an accumulation window \\(micro-step 1 of 2\\)"):
        mp.state_dict()
    other = mixprec.MixedPrecision("fp16-mixed", device="cpu")
    with pytest.raises(ValueError, match="saved with recipe 'fp32'"):
        other.load_state_dict({"recipe": "fp32", "scaler": {}, "steps": 3})
    other.load_state_dict({"recipe": "fp32", "scaler": {}, "steps": 3}, strict=False)


# ---------------------------------------------------------------- no host sync with fused optimizers


def test_step_with_fused_optimizer_never_reads_device_values_on_host(monkeypatch):
    mp = mixprec.MixedPrecision("fp16-mixed", device="cpu")
    model = mp.prepare(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = _batches(3)

    def boom(*a, **k):
        raise AssertionError("host sync inside MixedPrecision.step with a fused optimizer")

    losses = []
    for x, y in batches:
        with mp.autocast():
            out = model(x)
        loss = F.cross_entropy(out, y)
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, boom)
        stats = mp.step(loss, opt, max_grad_norm=1.0)
        monkeypatch.undo()
        losses.append(stats.loss)
    assert torch.isfinite(torch.stack(losses)).all()


# ---------------------------------------------------------------- misuse and bad input


def test_bad_inputs_give_errors_that_say_what_to_do():
    mp = mixprec.MixedPrecision("fp32", device="cpu")
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with pytest.raises(TypeError, match="expects the loss as a tensor"):
        mp.step(1.0, opt)
    with pytest.raises(ValueError, match="expects a scalar loss, got shape \\(16,\\); reduce it first"):
        mp.step(F.cross_entropy(model(x), y, reduction="none"), opt)
    with pytest.raises(ValueError, match="does not require grad"):
        mp.step(F.cross_entropy(model(x), y).detach(), opt)
    with pytest.raises(TypeError, match="expects torch.optim.Optimizer"):
        mp.step(F.cross_entropy(model(x), y), model)
    with pytest.raises(ValueError, match="at least one optimizer"):
        mp.step(F.cross_entropy(model(x), y), [])
    with pytest.raises(ValueError, match="accumulate must be an integer >= 1"):
        mixprec.MixedPrecision("fp32", device="cpu", accumulate=0)
    with pytest.raises(TypeError, match="prepare\\(\\) expects an nn.Module"):
        mp.prepare(object())
    with pytest.raises(ValueError, match="uses no loss scaler"):
        mixprec.MixedPrecision("bf16-mixed", device="cpu", scaler={"init_scale": 8.0})
    with pytest.raises(TypeError, match="pass its arguments as a dict"):
        mixprec.MixedPrecision("fp16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan")])
def test_a_clip_norm_that_is_not_positive_is_refused_before_backward(bad):
    # -1 would reverse the update (clip_grad_norm_ scales by max_norm / norm), 0 would zero it
    mp = mixprec.MixedPrecision("fp32", device="cpu")
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        mp.step(F.cross_entropy(model(x), y), opt, max_grad_norm=bad)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))


def test_one_rule_alone_is_a_rule_not_letters():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mp = mixprec.MixedPrecision("bf16-mixed", device="cpu", fp32_modules="1")
    mp.prepare(net)
    assert island_names(net) == ["1"]
    mp16 = mixprec.MixedPrecision("bf16-true", device="cpu", fp32_params="biases")
    net16 = mp16.prepare(nn.Sequential(nn.Linear(4, 4)))
    assert net16[0].bias.dtype == torch.float32 and net16[0].weight.dtype == torch.bfloat16


def test_a_bad_nan_guard_is_refused_at_construction():
    with pytest.raises(ValueError, match="nan_guard mode 'rase' is not one of raise, warn, record"):
        mixprec.MixedPrecision("fp32", device="cpu", nan_guard="rase")
    with pytest.raises(TypeError, match="nan_guard must be a bool"):
        mixprec.MixedPrecision("fp32", device="cpu", nan_guard=3)


def test_prepare_refuses_model_half_and_wrong_device_and_double_prepare():
    mp = mixprec.MixedPrecision("fp16-mixed", device="cpu")
    with pytest.raises(ValueError, match="model.half\\(\\) is low precision, not mixed precision"):
        mp.prepare(_mlp().half())
    model = mp.prepare(_mlp())
    assert mp.prepare(model) is model  # idempotent for the same recipe
    with pytest.raises(ValueError, match="already prepared for recipe 'fp16-mixed'"):
        mixprec.MixedPrecision("bf16-mixed", device="cpu").prepare(model)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            mixprec.MixedPrecision("fp16-mixed", device="cuda")


def test_sixteen_bit_loss_warns_once_and_is_cast_up():
    mp = mixprec.MixedPrecision("bf16-mixed", device="cpu")
    model = _mlp()  # not prepared: outputs stay bf16, so the loss is computed in bf16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with mp.autocast():
        loss = model(x).float().sum().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="reached step\\(\\) in bf16"):
        stats = mp.step(loss, opt)
    assert stats.loss.dtype == torch.float32
    with mp.autocast():
        loss = model(x).float().sum().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.step(loss, opt)


def test_describe_and_repr_name_the_recipe_and_reason():
    mp = mixprec.MixedPrecision("auto", device="cpu")
    text = mp.describe()
    assert mp.recipe.name in text and "auto:" in text
    assert repr(mp) == f"MixedPrecision({mp.recipe.name!r}, device='cpu')"


def test_skip_nonfinite_guards_a_recipe_without_scaler():
    mp = mixprec.MixedPrecision("bf16-mixed", device="cpu", skip_nonfinite=True)
    assert isinstance(mp.scaler, mixprec.StaticLossScaler) and mp.scaler.get_scale() == 1.0
    model = mp.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p.detach().clone() for p in model.parameters()]
    handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    (stats,) = _train(mp, model, opt, _batches(1))
    handle.remove()
    assert bool(stats.skipped)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params))
