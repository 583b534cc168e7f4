"""Master weights inside ``MixedPrecision``: equivalences, consistency, skipped steps, resume."""

from __future__ import annotations

import io

import pytest
import torch
from masters_helpers import (
    STORAGE_RECIPES, assert_bitwise_equal, assert_resume_bitwise, batch, setup, snapshot, tiny_gpt, train, without_generators,
)
from torch import nn

from mixprec import MixedPrecision
from mixprec.masters import nearest_bf16
from mixprec.tasks.charlm import CharGPT, lm_loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_true_with_fp32_masters_trains_bitwise_like_bf16_mixed(accumulate):
    # Same forward (autocast, islands, bf16 weights = bf16(master) as autocast would cast them),
    # same bf16 gradients, same fp32 accumulation and optimizer: only the storage differs.
    ref, mp_ref, opt_ref = setup("bf16-mixed", accumulate=accumulate)
    model, mp, opt = setup("bf16-true", accumulate=accumulate)
    a = train(ref, mp_ref, opt_ref, range(4), max_grad_norm=0.5)
    b = train(model, mp, opt, range(4), max_grad_norm=0.5)
    assert [float(s.loss) for s in a] == [float(s.loss) for s in b]
    masters = mp.masters.masters()
    for name, p in ref.named_parameters():
        mine = masters.get(name, dict(model.named_parameters())[name])
        assert mine.dtype == torch.float32 and torch.equal(mine, p), name


def test_fp16_true_trains_bitwise_like_fp16_mixed_including_a_skipped_step():
    ref, mp_ref, opt_ref = setup("fp16-mixed")
    model, mp, opt = setup("fp16-true")
    a = train(ref, mp_ref, opt_ref, range(4), poison={1})
    b = train(model, mp, opt, range(4), poison={1})
    assert [bool(s.skipped) for s in b] == [False, True, False, False]
    assert [(float(s.loss), float(s.scale)) for s in a] == [(float(s.loss), float(s.scale)) for s in b]
    masters = mp.masters.masters()
    for name, p in ref.named_parameters():
        assert torch.equal(masters.get(name, dict(model.named_parameters())[name]), p), name


@pytest.mark.parametrize("recipe, rounding", [("bf16-true", lambda m: m.to(torch.bfloat16)),
                                              ("fp16-true", lambda m: m.to(torch.float16)),
                                              ("bf16-true-remainder", nearest_bf16)])
def test_model_weight_is_its_master_rounded_after_every_step(recipe, rounding):
    model, mp, opt = setup(recipe)
    params = dict(model.named_parameters())
    for step in range(3):
        train(model, mp, opt, range(step, step + 1))
        for name, master in mp.masters.masters().items():
            assert params[name].dtype != torch.float32
            assert torch.equal(params[name].view(torch.int16), rounding(master).view(torch.int16)), (step, name)


def _tiny_gpt_without_bf16_ties(seed: int) -> nn.Module:
    """tiny_gpt with every fp32 weight that lies exactly halfway between two bf16 values moved one
    fp32 ulp up: ties-to-even and ties-away then round it alike. (Whether the random init holds such a
    tie depends on the CPU: torch's normal_ draws other values with ATEN_CPU_CAPABILITY=default.)"""
    model = tiny_gpt(seed)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.data.view(torch.int32)
            bits.add_(((bits & 0xFFFF) == 0x8000).to(torch.int32))
    return model


def test_remainder_master_is_the_fp32_master_exactly():
    # Same start and, with no exact ties in the weights, the same bf16 weights in the forward (ties
    # are where ties-away and ties-to-even differ), so the same gradients: one step of each must
    # leave the same fp32 masters.
    m1, mp1, o1 = setup("bf16-true", build=_tiny_gpt_without_bf16_ties)
    m2, mp2, o2 = setup("bf16-true-remainder", build=_tiny_gpt_without_bf16_ties)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(m1.parameters(), m2.parameters()) if a.dtype == torch.bfloat16)
    start = mp1.masters.masters()
    assert_bitwise_equal(start, mp2.masters.masters())
    train(m1, mp1, o1, range(1))
    train(m2, mp2, o2, range(1))
    assert_bitwise_equal(mp1.masters.masters(), mp2.masters.masters())


@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
def test_skipped_step_leaves_model_masters_and_optimizer_bitwise_unchanged(recipe):
    kwargs = {} if recipe == "fp16-true" else {"skip_nonfinite": True}
    model, mp, opt = setup(recipe, **kwargs)
    train(model, mp, opt, range(2))
    # one inf in one gradient element of a 16-bit weight is enough to skip the whole step
    w = model.blocks[0].fc.weight
    hook = w.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"), dtype=g.dtype)))
    before = without_generators(snapshot(model, mp, opt))
    (stats,) = train(model, mp, opt, range(2, 3))
    hook.remove()
    assert bool(stats.skipped)
    after = without_generators(snapshot(model, mp, opt))
    after["mp"]["steps"] = before["mp"]["steps"]  # the step counter counts attempts
    before["mp"]["scaler"], after["mp"]["scaler"] = {}, {}  # the scaler's own record moves, by design
    assert_bitwise_equal(before, after)


@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
def test_resume_from_checkpoint_continues_bit_for_bit(recipe):
    # the fresh run starts from a different init: loading must replace all of it
    assert_resume_bitwise(lambda: setup(recipe), range(2), range(2, 4), make_fresh=lambda: setup(recipe, seed=1))


def test_optimizer_state_loaded_between_steps_stays_fp32():
    # torch casts loaded optimizer state to its parameters' dtype: the masters are fp32 always.
    model, mp, opt = setup("bf16-true-kahan")
    train(model, mp, opt, range(1))
    opt.load_state_dict(snapshot(model, mp, opt)["opt"])
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.float32}


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # creates its state in __init__
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    ],
    ids=["adamw-fused", "sgd-momentum", "adagrad", "rmsprop"],
)
@pytest.mark.parametrize("recipe", ["bf16-true", "bf16-true-sr"])
def test_any_torch_optimizer_steps_the_fp32_masters(recipe, make):
    model, mp, opt = setup(recipe, optimizer=make)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, mp, opt, range(2))
    state = [v for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1]
    assert state and {v.dtype for v in state} == {torch.float32}
    w = dict(model.named_parameters())["blocks.0.fc.weight"]
    assert w.dtype == torch.bfloat16 and not torch.equal(w, before["blocks.0.fc.weight"])


def test_optimizer_built_over_the_16bit_parameters_is_refused_at_step():
    mp = MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(tiny_gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(0)
    with mp.autocast():
        loss = lm_loss(model(x), y)
    with pytest.raises(ValueError, match=r"blocks\.0\.qkv\.weight.*mp\.parameters\(model\)"):
        mp.step(loss, opt)
    with pytest.raises(RuntimeError, match=r"mp\.parameters\(model\)"):
        opt.step()  # and stepping it by hand is refused too
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stepping_the_masters_by_hand_is_refused():
    model, mp, opt = setup("bf16-true")
    x, y = batch(0)
    with mp.autocast():
        loss = lm_loss(model(x), y)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"mp\.step\(loss, optimizer\)"):
        opt.step()


def test_an_unrelated_optimizer_is_not_affected_by_the_guard():
    setup("bf16-true")
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    w.sum().backward()
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), 0.5))


def test_prepare_refuses_a_16bit_model_for_storage_and_mixed_recipes():
    with pytest.raises(ValueError, match=r"model\.float\(\) first"):
        MixedPrecision("bf16-true", "cpu").prepare(tiny_gpt().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"model\.half\(\) is low precision"):
        MixedPrecision("bf16-mixed", "cpu").prepare(tiny_gpt().half())


def test_fp16_gradients_are_unscaled_in_fp32_so_tiny_ones_survive():
    # true gradient 1e-8 is below fp16's smallest subnormal (6e-8): scaled by 2**16 it is 6.6e-4
    # in fp16; unscaled in fp16 it would flush to 0 again, unscaled in fp32 it is 1e-8.
    mp = MixedPrecision("fp16-true", "cpu", fp32_params=[], scaler={"init_scale": 2.0**16})
    model = mp.prepare(nn.Linear(1, 1, bias=False))
    opt = torch.optim.SGD(mp.parameters(model), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["params"][0].grad.clone()))
    with mp.autocast():
        out = model(torch.ones(1, 1))
    mp.step(1e-8 * out.sum(), opt)
    (grad,) = seen
    assert grad.dtype == torch.float32
    assert grad.item() == pytest.approx(1e-8, rel=1e-3)


def test_clipping_a_list_of_model_parameters_clips_their_masters():
    norms = []
    for params in (None, "model"):
        model, mp, opt = setup("bf16-true")
        kw = {} if params is None else {"parameters": list(model.parameters())}
        (stats,) = train(model, mp, opt, range(1), max_grad_norm=0.1, **kw)
        norms.append(float(stats.grad_norm))
    assert norms[0] == norms[1] > 0.1


@pytest.mark.parametrize("recipe, extra", [("bf16-true", 4), ("bf16-true-kahan", 2), ("bf16-true-remainder", 2),
                                           ("bf16-true-sr", 0), ("bf16-pure", 0)])
def test_strategies_hold_the_bytes_they_promise_between_steps(recipe, extra):
    model, mp, opt = setup(recipe)
    train(model, mp, opt, range(1))
    n16 = sum(s.param.numel() for s in mp.masters.slots)
    held = mp.masters.nbytes()
    assert held["stored_16bit"] == 2 * n16 and held["masters"] == extra * n16
    assert mp.masters.extra_bytes == extra
    # between steps the compact strategies' optimizer parameters hold no fp32 values
    proxies = [s.proxy for s in mp.masters.slots]
    if extra != 4:
        assert all(p.untyped_storage().nbytes() <= 4 for p in proxies)
    assert all(p.grad is None for p in proxies)


def test_stochastic_rounding_is_seeded_by_torch_manual_seed():
    runs = []
    for seed in (0, 0, 1):
        model = tiny_gpt(0)  # the same weights in every run
        torch.manual_seed(seed)  # the run's seed: prepare() seeds the rounding generator from it
        mp = MixedPrecision("bf16-true-sr", "cpu")
        model = mp.prepare(model)
        opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
        train(model, mp, opt, range(2))
        runs.append(model.blocks[0].fc.weight.detach().clone())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_checkpoint_from_another_strategy_is_refused():
    model, mp, opt = setup("bf16-true")
    state = mp.state_dict()
    _, mp2, _ = setup("bf16-true-kahan")
    with pytest.raises(ValueError, match="saved with recipe 'bf16-true'"):
        mp2.load_state_dict(state)
    with pytest.raises(ValueError, match="strategy 'fp32'"):
        mp2.load_state_dict(state, strict=False)


def test_state_dict_round_trips_through_torch_save():
    model, mp, opt = setup("bf16-true-remainder")
    train(model, mp, opt, range(1))
    buf = io.BytesIO()
    torch.save(mp.state_dict(), buf)
    buf.seek(0)
    _, mp2, _ = setup("bf16-true-remainder", seed=3)
    mp2.load_state_dict(torch.load(buf))
    assert_bitwise_equal(mp.masters.masters(), mp2.masters.masters())


def test_fused_optimizer_skips_on_device_and_leaves_fp16_true_unchanged():
    make = lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True)  # noqa: E731
    model, mp, opt = setup("fp16-true", optimizer=make)
    train(model, mp, opt, range(1))
    before = snapshot(model, mp, opt)
    (stats,) = train(model, mp, opt, range(1, 2), poison={1})
    assert bool(stats.skipped)
    after = snapshot(model, mp, opt)
    for key in ("model", "opt"):
        assert_bitwise_equal(before[key], after[key])
    assert_bitwise_equal(before["mp"]["masters"], after["mp"]["masters"])



@pytest.mark.parametrize("recipe", STORAGE_RECIPES)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_bucketing_does_not_change_a_bit(recipe, accumulate, monkeypatch):
    # The step runs on flat buckets of parameters; how they are cut must not show in the numbers.
    def run(limit):
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", limit)
        model, mp, opt = setup(recipe, accumulate=accumulate)
        train(model, mp, opt, range(6), poison={3}, max_grad_norm=1.0)
        return mp, snapshot(model, mp, opt)

    one_mp, one = run(1 << 24)
    many_mp, many = run(100)  # many small buckets; tensors above 100 elements each alone
    assert len(one_mp.masters.buckets) == 1 < len(many_mp.masters.buckets)
    assert [s for b in many_mp.masters.buckets for s in b.slots] == many_mp.masters.slots
    assert_bitwise_equal(one, many)


def test_a_replaced_proxy_value_is_still_written_back():
    # The write-back reads the flat buffer the proxies view; if something swapped a proxy's data
    # during the step, it must read the proxies instead of the stale buffer.
    model, mp, opt = setup("bf16-true-kahan")
    x, y = batch(0)
    with mp.autocast():
        loss = lm_loss(model(x), y)

    proxy = mp.masters.slots[0].proxy

    def swap(optimizer, args, kwargs):
        proxy.data = proxy.data.clone() + 1.0

    handle = opt.register_step_pre_hook(swap)
    before = mp.masters.masters()
    name = mp.masters.slots[0].name
    mp.step(loss, opt)
    handle.remove()
    after = mp.masters.masters()[name]
    assert (after - before[name]).abs().min() > 0.5  # the +1 reached the stored weights
    assert not after.requires_grad


@pytest.mark.parametrize("recipe", ["bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder"])
def test_a_masters_state_of_another_shape_is_refused_naming_the_parameter_and_nothing_is_loaded(recipe):
    wide = setup(recipe, build=lambda seed: CharGPT(d_model=48, n_layer=1, n_head=2, seq_len=16))[1]
    model, mp, opt = setup(recipe)
    train(model, mp, opt, range(2))
    before = snapshot(model, mp, opt)
    with pytest.raises(ValueError, match=r"does not fit parameter '.*': checkpoint \d+x48, model \d+x32"):
        mp.load_state_dict(wide.state_dict())
    assert_bitwise_equal(snapshot(model, mp, opt), before)  # refused before anything was written
