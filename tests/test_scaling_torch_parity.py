"""mixprec.GradScaler run through the behaviours torch's own grad-scaling tests check, side by side
with torch.amp.GradScaler("cpu").

An adaptation (not a copy) of the cases in pytorch's test/test_torch.py (``test_grad_scaling_*``,
``test_grad_scaler_*``) and the helpers in torch/testing/_internal/common_cuda.py: a control model
trained without scaling and a scaled model with one injected overflow must end with the same
parameters and optimizer state; the scale must have grown once per clean step and backed off once
per skipped one. Every case runs on both scalers and the two must agree bit for bit (scale, skip
decisions, parameters, optimizer state, return values, errors).
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch

import mixprec
from mixprec.scaling import ScalerConfigError

SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}


def _models(optimizer_ctor, optimizer_kwargs=None):
    """A control module/optimizer (no scaling) and an identical one to train with a scaler."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return control, scaled, optimizer_ctor(control.parameters(), **kwargs), optimizer_ctor(scaled.parameters(), **kwargs)


def _data(n: int = 4):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


SKIP_ITER = 2


def _inject(model, i, scaler):
    if i == SKIP_ITER and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(float("inf"))


# ---------------------------------------------------------------- the training patterns


def _run_plain(data, model, opt, scaler, loss_fn, use_scaler, *, pickle_each=False):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if use_scaler:
            scaler.scale(loss).backward()
            _inject(model, i, scaler)
            scaler.step(opt)
            scaler.update()
            if pickle_each:
                scaler = pickle.loads(pickle.dumps(scaler))
        else:
            loss.backward()
            if not scaler.is_enabled() or i != SKIP_ITER:
                opt.step()
    return scaler


def _run_clipping(data, model, opt, scaler, loss_fn, use_scaler, max_norm=0.2):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if use_scaler:
            scaler.scale(loss).backward()
            _inject(model, i, scaler)  # before unscale_: that is where the inf check happens
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not scaler.is_enabled() or i != SKIP_ITER:
                opt.step()
    return scaler


def _run_accumulation(data, model, opt, scaler, loss_fn, use_scaler, iters_to_accumulate=2):
    for i, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y) / iters_to_accumulate
        if use_scaler:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % iters_to_accumulate == 0:
            if use_scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return scaler


def _run_penalty(data, model, opt, scaler, loss_fn, use_scaler):
    """A gradient penalty: autograd.grad of the scaled loss, unscaled by hand."""
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        target = scaler.scale(loss) if use_scaler else loss
        grads = torch.autograd.grad(target, model.parameters(), create_graph=True)
        if use_scaler:
            inv = 1.0 / scaler.get_scale()
            grads = [g * inv for g in grads]
        penalty = sum(g.pow(2).sum() for g in grads).sqrt()
        loss = loss + penalty
        if use_scaler:
            scaler.scale(loss).backward()
            _inject(model, i, scaler)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if not scaler.is_enabled() or i != SKIP_ITER:
                opt.step()
    return scaler


RUNS = {
    # (pattern, clean steps, skipped steps)
    "plain": (_run_plain, 3, 1),
    "pickled-each-step": (lambda *a: _run_plain(*a, pickle_each=True), 3, 1),
    "clipping": (_run_clipping, 3, 1),
    "accumulation": (_run_accumulation, 2, 0),
    "penalty": (_run_penalty, 3, 1),
}

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "sgd-foreach": (torch.optim.SGD, {"momentum": 0.9, "foreach": True}),
    "sgd-fused": (torch.optim.SGD, {"fused": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-fused": (torch.optim.Adam, {"lr": 0.01, "fused": True}),
    "adamw-fused": (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
    "adagrad-fused": (torch.optim.Adagrad, {"lr": 0.01, "fused": True}),
}


def _scaling_case(cls, run, enabled, opt_name):
    ctor, kwargs = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    control, scaled, opt_c, opt_s = _models(ctor, kwargs)
    scaler = cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
    loss_fn = torch.nn.MSELoss()
    run(_data(), control, opt_c, scaler, loss_fn, False)
    scaler = run(_data(), scaled, opt_s, scaler, loss_fn, True) or scaler
    return scaler, control, scaled, opt_c, opt_s


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("run_name", list(RUNS))
@pytest.mark.parametrize("enabled", [True, False])
def test_scaling_case_matches_control_and_torch(run_name, opt_name, enabled):
    run, unskipped, skipped = RUNS[run_name]
    results = {}
    for name, cls in SCALERS.items():
        scaler, control, scaled, opt_c, opt_s = _scaling_case(cls, run, enabled, opt_name)
        if enabled:  # (a disabled scaler has no factors: torch's getters raise AttributeError)
            expected = 128.0 * scaler.get_growth_factor() ** unskipped * scaler.get_backoff_factor() ** skipped
            assert scaler.get_scale() == expected, name
        else:
            assert scaler.get_scale() == 1.0, name
        for c, s in zip(control.parameters(), scaled.parameters()):
            # the scaled run differs from the control only by the rounding of x*scale/scale (exact
            # for a power-of-two scale) and of the penalty's hand-unscaled grads: a few float32 ulps
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-6)
            for k in opt_c.state[c]:
                torch.testing.assert_close(opt_s.state[s][k], opt_c.state[c][k], rtol=1e-5, atol=1e-6)
        results[name] = (scaler.get_scale(), [p.detach().clone() for p in scaled.parameters()],
                         [dict(opt_s.state[p]) for p in scaled.parameters()])
    (st, pt, ot), (sm, pm, om) = results["torch"], results["mixprec"]
    assert st == sm
    for a, b in zip(pt, pm):
        assert torch.equal(a, b)
    for a, b in zip(ot, om):
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def _run_multiple(cls, enabled):
    """Two models, two optimizers, two losses, one scaler; the overflow is in one model only."""
    torch.manual_seed(0)
    a_c, a_s, oa_c, oa_s = _models(torch.optim.SGD)
    b_c, b_s, ob_c, ob_s = _models(torch.optim.SGD)
    scaler = cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
    loss_fn = torch.nn.MSELoss()
    returns = []
    for use in (False, True):
        ma, mb, oa, ob = (a_s, b_s, oa_s, ob_s) if use else (a_c, b_c, oa_c, ob_c)
        for i, (x, y) in enumerate(_data()):
            oa.zero_grad()
            ob.zero_grad()
            out_a = ma(x)
            out_b = mb(x)
            loss0 = loss_fn(0.3 * out_a + 0.7 * out_b, y)
            loss1 = loss_fn(0.6 * out_a - 0.4 * out_b, y)
            if use:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                _inject(mb, i, scaler)
                scaler.unscale_(oa)
                returns.append((scaler.step(oa), scaler.step(ob)))
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                oa.step()
                if not scaler.is_enabled() or i != SKIP_ITER:
                    ob.step()
    return scaler, [a_c, b_c], [a_s, b_s], returns


@pytest.mark.parametrize("enabled", [True, False])
def test_multiple_models_optimizers_losses_match_control_and_torch(enabled):
    got = {}
    for name, cls in SCALERS.items():
        scaler, controls, scaleds, returns = _run_multiple(cls, enabled)
        assert scaler.get_scale() == ((128.0 * 2.0**3 * 0.5) if enabled else 1.0)
        for mc, ms in zip(controls, scaleds):
            for c, s in zip(mc.parameters(), ms.parameters()):
                torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-6)
        got[name] = ([p.detach().clone() for m in scaleds for p in m.parameters()], returns)
    for a, b in zip(got["torch"][0], got["mixprec"][0]):
        assert torch.equal(a, b)
    assert got["torch"][1] == got["mixprec"][1]


# ---------------------------------------------------------------- scale(), get_scale(), state


@pytest.mark.parametrize("name", list(SCALERS))
def test_scale_tensors_lists_tuples_nested_iterables(name):
    s = SCALERS[name]("cpu", init_scale=2.0)
    t0 = torch.full((1,), 4.0)
    t1 = torch.full((1,), 4.0)
    out = s.scale((t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())]))
    assert isinstance(out, tuple) and isinstance(out[1], tuple) and isinstance(out[2], list)
    assert isinstance(out[2][1], tuple)
    flat = [out[0], out[1][0], out[1][1], out[2][0], out[2][1][0], out[2][1][1]]
    assert all(v.item() == 8.0 for v in flat)
    assert s._scale.device == t1.device and s._scale.dtype == torch.float32 and s._scale.dim() == 0
    gen = s.scale(x for x in (t0, t1))  # a generator: a lazy map, as torch
    assert [v.item() for v in gen] == [8.0, 8.0]
    assert s.scale(torch.tensor(3.0, dtype=torch.bfloat16)).dtype == torch.float32  # type promotion
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        s.scale([t0, 1.0])


@pytest.mark.parametrize("name", list(SCALERS))
def test_get_scale_is_enabled_and_accessors_before_and_after_steps(name):
    s = SCALERS[name]("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    assert s.is_enabled() and s.get_scale() == 3.0 and s._scale is None  # lazily created
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.25, 2)
    s.set_growth_factor(8.0)
    s.set_backoff_factor(0.125)
    s.set_growth_interval(3)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (8.0, 0.125, 3)
    d = SCALERS[name]("cpu", enabled=False)
    x = torch.ones(2)
    assert not d.is_enabled() and d.get_scale() == 1.0 and d.state_dict() == {} and d.scale(x) is x
    assert d._get_growth_tracker() == 0


def _steps(scaler, pattern, opt_ctor=torch.optim.SGD, fused=False):
    """One parameter trained over ``pattern`` (True = overflow): the scales seen after each update."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = opt_ctor([w], lr=0.1, fused=fused) if fused else opt_ctor([w], lr=0.1)
    scales, rets = [], []
    for bad in pattern:
        opt.zero_grad()
        scaler.scale((w * w).sum()).backward()
        if bad:
            w.grad[1] = float("nan") if len(scales) % 2 else float("inf")
        rets.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, rets, w.detach().clone()


@pytest.mark.parametrize("fused", [False, True])
def test_growth_and_backoff_sequences_match_torch(fused):
    pattern = [False, False, True, False, True, True, False, False, False, False, True] + [False] * 7
    kw = dict(init_scale=2.0**5, growth_factor=3.0, backoff_factor=0.3, growth_interval=3)
    t = _steps(torch.amp.GradScaler("cpu", **kw), pattern, torch.optim.Adam, fused)
    m = _steps(mixprec.GradScaler("cpu", **kw), pattern, torch.optim.Adam, fused)
    assert t[0] == m[0] and t[1] == m[1] and torch.equal(t[2], m[2])


def test_repeated_backoff_reaches_zero_like_torch_by_default():
    t = _steps(torch.amp.GradScaler("cpu", init_scale=2.0**-120), [True] * 40)[0]
    m = _steps(mixprec.GradScaler("cpu", init_scale=2.0**-120), [True] * 40)[0]
    assert t == m and m[-1] == 0.0


@pytest.mark.parametrize("name", list(SCALERS))
def test_step_returns_the_optimizers_return_value_or_none_when_skipped(name):
    class Returning(torch.optim.SGD):
        def step(self, closure=None, tag=None):
            super().step()
            return ("stepped", tag)

    w = torch.nn.Parameter(torch.ones(2))
    opt = Returning([w], lr=0.1)
    s = SCALERS[name]("cpu")
    s.scale(w.sum()).backward()
    assert s.step(opt, tag=7) == ("stepped", 7)
    s.update()
    s.scale(w.sum()).backward()
    w.grad[0] = float("inf")
    assert s.step(opt, tag=8) is None
    s.update()
    d = SCALERS[name]("cpu", enabled=False)  # disabled: a plain pass-through, positional args too
    assert d.step(opt, None, 9) == ("stepped", 9)


@pytest.mark.parametrize("name", list(SCALERS))
def test_misuse_raises_torchs_errors(name):
    cls = SCALERS[name]
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s = cls("cpu")
    with pytest.raises(AssertionError, match=r"Attempted step but _scale is None\.  This may indicate"):
        s.step(opt)
    with pytest.raises(AssertionError, match="Attempted unscale_ but _scale is None"):
        s.unscale_(opt)
    with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
        s.update()
    s.scale(w.sum()).backward()
    with pytest.raises(RuntimeError, match="^Closure use is not currently supported if GradScaler is enabled.$"):
        s.step(opt, closure=lambda: None)
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer since the last update\(\).$"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update\(\).$"):
        s.step(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) is being called after step\(\).$"):
        s.unscale_(opt)
    s.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        s.update()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # no grads at all
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer."):
        s.step(opt2)


@pytest.mark.parametrize("name", list(SCALERS))
def test_update_new_scale_float_and_tensor(name):
    s = SCALERS[name]("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update(16.0)
    assert s.get_scale() == 16.0
    src = torch.tensor(32.0)
    s.update(src)
    src.fill_(1.0)  # copied, not aliased
    assert s.get_scale() == 32.0 and s._get_growth_tracker() == 0
    for bad in (torch.ones(2), torch.tensor(2.0, requires_grad=True)):
        with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
            s.update(bad)


# ---------------------------------------------------------------- state_dict, pickling


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("src_name", list(SCALERS))
@pytest.mark.parametrize("dst_name", list(SCALERS))
def test_state_dict_loads_across_torch_and_mixprec(src_name, dst_name, lazy):
    s0 = SCALERS[src_name]("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = SCALERS[dst_name]("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7
    if lazy:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())  # saved before any step
    assert s1.get_scale() == 3.0 and s1._get_growth_tracker() == 0
    assert (s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (4.0, 0.5, 2)
    assert s1._init_growth_tracker == 0


@pytest.mark.parametrize("src_name", list(SCALERS))
@pytest.mark.parametrize("dst_name", list(SCALERS))
def test_resume_mid_training_across_scalers_continues_like_uninterrupted(src_name, dst_name):
    pattern = [False, True, False, False, False, True, False, False, False, False]
    kw = dict(init_scale=2.0**6, growth_interval=3)
    full = _steps(torch.amp.GradScaler("cpu", **kw), pattern)
    first = SCALERS[src_name]("cpu", **kw)
    _steps(first, pattern[:4])
    second = SCALERS[dst_name]("cpu")
    second.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    assert second.get_scale() == first.get_scale() and second._get_growth_tracker() == first._get_growth_tracker()
    # the rest of the run, from the same weights: the scales must continue as in the full run
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for bad in pattern[4:]:
        opt.zero_grad()
        second.scale((w * w).sum()).backward()
        if bad:
            w.grad[1] = float("inf")
        second.step(opt)
        second.update()
        scales.append(second.get_scale())
    assert scales == full[0][4:]


@pytest.mark.parametrize("name", list(SCALERS))
def test_pickle_and_deepcopy_between_iterations(name):
    s = SCALERS[name]("cpu", init_scale=16.0, growth_interval=2)
    fresh = pickle.loads(pickle.dumps(s))  # before any scale()
    assert fresh.get_scale() == 16.0
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):
        s.scale(w.sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    for clone in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert clone.get_scale() == s.get_scale() == 32.0
        assert clone._get_growth_tracker() == s._get_growth_tracker() == 1
        clone.scale(w.sum()).backward()
        clone.step(opt)
        clone.update()
        assert clone.get_scale() == 64.0
        opt.zero_grad()
    s.scale(w.sum()).backward()
    s.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning of an iteration"):
        pickle.dumps(s)


# ---------------------------------------------------------------- gradients: sparse, fp16, fused


@pytest.mark.parametrize("name", list(SCALERS))
def test_unscale_sparse_grads(name):
    s = SCALERS[name]("cpu")
    inv_scale = torch.full((1,), 0.25)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([16.0, 32.0, 64.0])
    sp = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)
    p = sp.clone()
    opt = torch.optim.SGD([p], lr=1.0)

    def check(grad, allow_fp16):
        p.grad = grad
        found = torch.zeros(1)
        return s._unscale_grads_(opt, inv_scale, found, allow_fp16)[found.device]

    assert check(sp.clone(), False).item() == 0.0
    assert torch.equal(p.grad.to_dense(), (sp / 4).to_dense())
    v[2] = float("inf")
    assert check(torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True), False).item() == 1.0
    v[2] = float("nan")
    assert check(torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True), False).item() == 1.0
    # fp16: values that only overflow once duplicates are summed (coalesced)
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p = sp.clone().half()
    opt = torch.optim.SGD([p], lr=1.0)
    assert check(torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True).half(), True).item() == 0.0
    i_dup = torch.tensor([[0, 1, 0], [2, 0, 2]])
    assert check(torch.sparse_coo_tensor(i_dup, v, (2, 3), check_invariants=True).half(), True).item() == 1.0


def test_sparse_embedding_training_matches_torch():
    got = {}
    for name, cls in SCALERS.items():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        s = cls("cpu", init_scale=2.0**4, growth_interval=2)
        for it in range(5):
            opt.zero_grad()
            s.scale(emb(torch.tensor([1, 3, 3, 7])).sum()).backward()
            if it == 2:
                bad = torch.full((1, 4), float("inf"))
                emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), bad, (10, 4), check_invariants=True)
            s.step(opt)
            s.update()
        got[name] = (s.get_scale(), emb.weight.detach().clone())
    assert got["torch"][0] == got["mixprec"][0] and torch.equal(got["torch"][1], got["mixprec"][1])


def test_fp16_grads_refused_like_torch_only_when_disallowed():
    for s in (torch.amp.GradScaler("cpu"), mixprec.GradScaler("cpu", allow_fp16_grads=False)):
        w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        opt = torch.optim.SGD([w], lr=0.1)
        s.scale(w.float().sum()).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            s.step(opt)
    # mixprec's documented departure: unscaled in place
    s = mixprec.GradScaler("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.5)
    s.scale(w.float().sum()).backward()
    s.step(opt)
    s.update()
    assert w.tolist() == [0.5, 0.5]


@pytest.mark.parametrize("name", list(SCALERS))
def test_optimizer_with_grad_scaler_kwarg_gets_the_scaler_and_a_future_warning(name):
    seen = []

    class Custom(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            seen.append(grad_scaler)
            return "custom"

    w = torch.nn.Parameter(torch.ones(2))
    opt = Custom([w], lr=0.1)
    s = SCALERS[name]("cpu")
    s.scale(w.sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        assert s.step(opt) == "custom"
    assert seen == [s]


def test_fused_optimizer_after_unscale_does_not_unscale_again():
    """unscale_ (to clip) then a fused step: the optimizer must not divide by the scale again."""
    got = {}
    for name, cls in SCALERS.items():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        ref = torch.nn.Parameter(w.detach().clone())
        opt = torch.optim.Adam([w], lr=0.1, fused=True)
        ref_opt = torch.optim.Adam([ref], lr=0.1, fused=True)
        s = cls("cpu", init_scale=2.0**8)
        s.scale((w * 3).sum()).backward()
        s.unscale_(opt)
        assert torch.equal(w.grad, torch.full((4,), 3.0))
        s.step(opt)
        s.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        (ref * 3).sum().backward()
        ref_opt.step()
        assert torch.equal(w, ref), name
        got[name] = w.detach().clone()
    assert torch.equal(got["torch"], got["mixprec"])


# ---------------------------------------------------------------- mixprec's own checks on top


@pytest.mark.parametrize("kwargs, match", [
    (dict(growth_factor=float("nan")), "growth factor"),
    (dict(growth_factor=float("inf")), "growth factor"),
    (dict(growth_factor="2"), "growth factor"),
    (dict(backoff_factor=float("nan")), "backoff factor"),
    (dict(backoff_factor=0.0), "backoff factor"),
    (dict(backoff_factor=-0.5), "backoff factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=-3), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(growth_interval="10"), "growth_interval"),
    (dict(growth_interval=True), "growth_interval"),
])
def test_bad_factors_and_interval_are_refused_at_construction(kwargs, match):
    """torch accepts these and fails later (a raw TypeError at the first update), or never (a NaN
    scale); mixprec's own state_dict() of such a scaler would not load back."""
    with pytest.raises(ScalerConfigError, match=match):
        mixprec.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize("setter, value", [
    ("set_growth_factor", 0.5), ("set_growth_factor", float("nan")), ("set_backoff_factor", 1.0),
    ("set_backoff_factor", 0.0), ("set_growth_interval", 0), ("set_growth_interval", 1.5),
])
def test_setters_refuse_what_the_constructor_refuses(setter, value):
    s = mixprec.GradScaler("cpu")
    before = s.state_dict()
    with pytest.raises(ScalerConfigError):
        getattr(s, setter)(value)
    assert s.state_dict() == before
    mixprec.GradScaler("cpu").load_state_dict(s.state_dict())  # still loadable


def _scaled_once():
    """A scaler at 8 and one scaled backward of an SGD model, before step."""
    s = mixprec.GradScaler("cpu", init_scale=8.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    return s, w, opt


def test_update_with_new_scale_still_records_a_skipped_step():
    s, w, opt = _scaled_once()
    w.grad[0] = float("inf")
    assert s.step(opt) is None
    s.update(4.0)
    assert s.get_scale() == 4.0
    assert s.was_skipped() and bool(s.last_skipped) and int(s.skipped_steps) == 1
    h = s.history()
    assert h["skipped"].tolist() == [True] and h["scale"].tolist() == [8.0]
    opt.zero_grad()
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update(2.0)
    assert not s.was_skipped() and int(s.skipped_steps) == 1 and s.history()["skipped"].tolist() == [True, False]


def test_update_with_a_refused_new_scale_records_nothing_and_can_be_retried():
    s, w, opt = _scaled_once()
    w.grad[0] = float("nan")
    s.step(opt)
    with pytest.raises(ScalerConfigError, match="new_scale must be a finite float > 0"):
        s.update(float("nan"))
    assert s.history()["step"].tolist() == [] and s.get_scale() == 8.0
    s.update(2.0)
    assert s.history()["skipped"].tolist() == [True] and int(s.skipped_steps) == 1 and s.get_scale() == 2.0


@pytest.mark.parametrize("name", list(SCALERS))
def test_disabled_scaler_setters_work_like_torch(name):
    s = SCALERS[name]("cpu", enabled=False)
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(5)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 5)


@pytest.mark.parametrize("torch_scale, match", [(2.0**-4, "below min_scale"), (2.0**20, "above max_scale")])
def test_torch_state_outside_this_scalers_bounds_is_refused_before_loading(torch_scale, match):
    """A torch state carries no bounds: its scale must fit the ones this scaler was built with
    (torch's scale may have collapsed far below a floor mixprec then would not enforce)."""
    m = mixprec.GradScaler("cpu", init_scale=8.0, min_scale=1.0, max_scale=2.0**10)
    m.scale(torch.ones(1))
    before = m.state_dict()
    with pytest.raises(ScalerConfigError, match=match):
        m.load_state_dict(torch.amp.GradScaler("cpu", init_scale=torch_scale).state_dict())
    assert m.state_dict() == before
    m.load_state_dict(torch.amp.GradScaler("cpu", init_scale=2.0**5).state_dict())  # in range: loads
    assert m.get_scale() == 32.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adam-fused", "adamw-fused"])
def test_cpu_autocast_training_matches_torch_bitwise(dtype, opt_name):
    """The loop of torch's autocast grad-scaling tests: forward under CPU autocast, one injected
    overflow, growth every clean step."""
    ctor, kwargs = OPTIMIZERS[opt_name]
    got = {}
    for name, cls in SCALERS.items():
        torch.manual_seed(0)
        _, model, _, opt = _models(ctor, kwargs)
        s = cls("cpu", init_scale=128.0, growth_interval=1)
        skipped = []
        for i, (x, y) in enumerate(_data(6)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x), y)
            s.scale(loss).backward()
            _inject(model, i, s)
            skipped.append(s.step(opt) is None)  # (a fused optimizer skips on the device: None always)
            s.update()
        got[name] = (s.get_scale(), skipped, [p.detach().clone() for p in model.parameters()])
    assert got["torch"][0] == got["mixprec"][0] == 128.0 * 2**5 * 0.5
    assert got["torch"][1] == got["mixprec"][1]
    for a, b in zip(got["torch"][2], got["mixprec"][2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(SCALERS))
def test_scale_does_not_grow_to_inf(name):
    s = SCALERS[name]("cpu", init_scale=2.0**127, growth_interval=1)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    for _ in range(3):
        s.scale(w.sum() * 0).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert s.get_scale() == 2.0**127


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_step_record_survives_pickling(fused, how):
    """A copy made between iterations reports the last step as the original does (a fused step's
    skip is known only from its device tensor, which pickling used to drop)."""
    s = mixprec.GradScaler("cpu", init_scale=8.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w], lr=0.1, fused=fused)
    for bad in (False, True):
        opt.zero_grad()
        s.scale(w.sum()).backward()
        if bad:
            w.grad[0] = float("inf")
        s.step(opt)
        s.update()
    c = pickle.loads(pickle.dumps(s)) if how == "pickle" else copy.deepcopy(s)
    assert c.was_skipped() and bool(c.last_skipped) and c.last_scale.item() == 8.0
    assert int(c.skipped_steps) == 1
    assert c.history()["skipped"].tolist() == [False, True] and c.history()["scale"].tolist() == [8.0, 8.0]
    opt.zero_grad()
    c.scale(w.sum()).backward()  # and the record goes on
    c.step(opt)
    c.update()
    assert not c.was_skipped() and int(c.skipped_steps) == 1
    assert c.history()["skipped"].tolist() == [False, True, False] and c.history()["step"].tolist() == [0, 1, 2]
