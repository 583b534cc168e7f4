"""Training loops as real scripts write them: what MixedPrecision refuses, and what it supports.

Each test is a defect found by probing: a model cast after prepare trained another precision than the
recipe's without a word; a 16-bit parameter added after prepare was stepped without a master; a
master-weight state of another dtype was converted into the masters on load; a strict load of a
state without its masters resumed without them; a closure optimizer (LBFGS) and clipping sparse
gradients failed with torch's raw errors.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

STORAGE = ["bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "fp16-true"]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(mp, model, opt, steps: int = 1, **kw):
    x, y = _batch()
    stats = None
    for _ in range(steps):
        with mp.autocast():
            out = model(x)
        stats = mp.step(F.cross_entropy(out, y), opt, **kw)
    return stats


def _snapshot(mp, model, opt, masters: bool = True):
    return ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()),
            mp.masters.masters() if mp.masters is not None and masters else {}, mp._steps)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------- a model cast after prepare


@pytest.mark.parametrize("recipe,cast", [
    ("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16),  # no norm island: nothing else would say
    *[(r, torch.float32) for r in STORAGE],  # model.float(): 16-bit storage upcast behind the masters
])
def test_a_model_cast_after_prepare_is_refused_before_the_optimizer_steps(recipe, cast):
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    _train(mp, model, opt)
    model.to(cast)
    before = _snapshot(mp, model, opt, masters=False)  # (the remainder masters cannot be read from a cast model)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' .* cast after prepare .* Do not cast a prepared model"):
        _train(mp, model, opt)
    assert _same(before, _snapshot(mp, model, opt, masters=False))  # nothing stepped, no step counted
    assert all(p.grad is None for p in model.parameters())  # the window was discarded


def test_moving_a_prepared_model_to_its_own_device_and_dtype_still_trains():
    for recipe in ["fp32", "bf16-mixed", "bf16-true"]:
        mp = mixprec.MixedPrecision(recipe, "cpu")
        model = mp.prepare(_net())
        opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
        model.to("cpu")
        assert _train(mp, model, opt, steps=2).step == 2


def test_the_cast_check_runs_at_the_boundary_under_accumulation():
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu", accumulate=2)
    model = mp.prepare(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(mp, model, opt, steps=2)
    model.half()
    w = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="cast after prepare"):
        _train(mp, model, opt, steps=2)
    assert torch.equal(model[0].weight, w) and mp._steps == 1 and mp._micro == 0


# ---------------------------------------------------------------- 16-bit parameters without masters


def test_a_16bit_parameter_added_after_prepare_is_refused_not_stepped_without_a_master():
    mp = mixprec.MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    model.append(nn.Linear(4, 4).to(torch.bfloat16))
    opt.add_param_group({"params": list(model[3].parameters())})
    w = model[3].weight.detach().clone()
    with pytest.raises(ValueError, match="mp.prepare did not store .* no fp32 master"):
        _train(mp, model, opt)
    assert torch.equal(model[3].weight, w)


def test_an_fp32_parameter_added_after_prepare_still_trains_in_fp32():
    mp = mixprec.MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    model.append(nn.Linear(4, 4))
    opt.add_param_group({"params": list(model[3].parameters())})
    w = model[3].weight.detach().clone()
    _train(mp, model, opt)
    assert model[3].weight.dtype == torch.float32 and not torch.equal(model[3].weight, w)


# ---------------------------------------------------------------- loading a damaged state


@pytest.mark.parametrize("recipe", STORAGE)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_a_master_state_of_another_dtype_is_refused_before_anything_is_written(recipe, dtype):
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    _train(mp, model, opt, steps=2)
    state = copy.deepcopy(mp.state_dict())
    for slot in state["masters"]["params"].values():  # an edited checkpoint: every tensor converted
        for key in slot:
            slot[key] = slot[key].to(dtype)
    before = _snapshot(mp, model, opt)
    with pytest.raises(ValueError, match="was edited or converted"):
        mp.load_state_dict(state)
    assert _same(before, _snapshot(mp, model, opt))


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-mixed"])
def test_a_strict_load_refuses_a_state_whose_masters_do_not_match_the_recipe(recipe):
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    _train(mp, model, opt, steps=2)
    state = dict(mp.state_dict())
    if "masters" in state:
        del state["masters"]
    else:
        state["masters"] = {"kind": "fp32", "storage": "bf16", "params": {}}
    before = _snapshot(mp, model, opt)
    with pytest.raises(ValueError, match="master weights"):
        mp.load_state_dict(state)
    assert _same(before, _snapshot(mp, model, opt))
    mp.load_state_dict(state, strict=False)  # (its other parts, when asked for)


@pytest.mark.parametrize("recipe", ["bf16-true", "fp32", "fp16-mixed"])
def test_a_scaler_state_that_is_not_a_dict_is_refused(recipe):
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    _train(mp, model, opt)
    state = {**mp.state_dict(), "scaler": "65536.0"}
    with pytest.raises(TypeError, match="'scaler' must be the dict"):
        mp.load_state_dict(state)
    assert mp._steps == 1


# ---------------------------------------------------------------- optimizers and gradients


@pytest.mark.parametrize("recipe", ["fp32", "fp16-mixed", "bf16-true"])
def test_a_closure_optimizer_is_refused_before_backward(recipe):
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(_net())
    opt = torch.optim.LBFGS(mp.parameters(model))
    with pytest.raises(TypeError, match="LBFGS.step\\(\\) needs a closure"):
        _train(mp, model, opt)
    assert all(p.grad is None for p in model.parameters()) and mp._steps == 0


class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 8, sparse=sparse)
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(self.emb(x).mean(1))


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"])
def test_clipping_sparse_gradients_clips_them_as_their_dense_twins(recipe):
    """torch's clip_grad_norm_ has no sparse norm; the step's clip takes a sparse gradient's norm from
    its coalesced values. Against the same model with a dense embedding: the same norm up to the order
    of an fp32 sum (n terms: relative error at most n * 2**-24, n = 30 * 8 + 3 * 8 + 3)."""
    x = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(3))
    norms, weights = [], []
    fp32_params = () if "true" in recipe else None  # the embedding stored in 16 bits too
    for sparse in (True, False):
        mp = mixprec.MixedPrecision(recipe, "cpu", fp32_params=fp32_params)
        model = mp.prepare(_Bag(sparse))
        named = mp.named_parameters(model)
        emb = [p for n, p in named if n.startswith("emb")]
        rest = [p for n, p in named if not n.startswith("emb")]
        opts = [torch.optim.SparseAdam(emb, lr=0.1) if sparse else torch.optim.Adam(emb, lr=0.1),
                torch.optim.Adam(rest, lr=0.1)]
        with mp.autocast():
            out = model(x)
        stats = mp.step(F.cross_entropy(out, y), opts, max_grad_norm=1e-3)
        assert not bool(stats.skipped)
        norms.append(float(stats.grad_norm))
        weights.append(model.emb.weight.detach().float().clone())
    n = 30 * 8 + 3 * 8 + 3
    assert norms[0] == pytest.approx(norms[1], rel=n * 2.0**-24, abs=0)
    assert norms[0] > 1e-3  # the clip was real: both moved their weights from the same start
    start = _Bag(False).emb.weight.detach().float()
    assert not torch.equal(weights[0], start) and not torch.equal(weights[1], start)


def test_the_scheduler_does_not_advance_on_a_skipped_step_and_torch_does_not_warn():
    mp = mixprec.MixedPrecision("fp16-mixed", "cpu", scaler={"init_scale": 2.0**126})  # overflows: skipped
    model = mp.prepare(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        stats = _train(mp, model, opt, scheduler=sched)
        assert bool(stats.skipped) and stats.stepped and stats.step == 1
        assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1
        mp.scaler.update(2.0**10)
        stats = _train(mp, model, opt, scheduler=sched)
    assert not bool(stats.skipped) and stats.step == 2
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
