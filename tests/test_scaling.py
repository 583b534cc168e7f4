"""mixprec.GradScaler beyond torch: errors, hysteresis, bounds, records, no-sync, state."""

from __future__ import annotations

import pickle
import random
import warnings

import pytest
import torch

import mixprec
from mixprec.scaling import ScalerConfigError


def _param_and_opt(n: int = 4, fused: bool = False, opt: str = "sgd"):
    w = torch.nn.Parameter(torch.ones(n))
    if opt == "sgd":
        o = torch.optim.SGD([w], lr=0.1, fused=fused)
    else:
        o = torch.optim.AdamW([w], lr=0.1, fused=fused)
    return w, o


def _one_step(scaler, w, opt, overflow: bool = False):
    scaler.scale((w * 2.0).sum()).backward()
    if overflow:
        w.grad[0] = float("inf")
    ret = scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return ret


# ---------------------------------------------------------------- errors: the same as torch's


def test_unscale_twice_before_update_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum()).backward()
        s.unscale_(o)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called on this optimizer since the last update"):
            s.unscale_(o)


def test_unscale_after_step_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum()).backward()
        s.step(o)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
            s.unscale_(o)


def test_step_twice_before_update_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum()).backward()
        s.step(o)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update"):
            s.step(o)


def test_closure_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum()).backward()
        with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
            s.step(o, closure=lambda: 0.0)


def test_update_without_inf_checks_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum())
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
            s.update()


def test_update_twice_per_step_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        s.scale(w.sum()).backward()
        s.step(o)
        s.update()
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
            s.update()


def test_step_before_scale_raises_like_torch():
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        s = cls("cpu")
        w, o = _param_and_opt()
        with pytest.raises(AssertionError, match="_scale is None"):
            s.step(o)


@pytest.mark.parametrize("kwargs,match", [({"growth_factor": 1.0}, "growth factor must be > 1.0"), ({"backoff_factor": 1.0}, "backoff factor must be < 1.0")])
def test_bad_factors_raise_assertion_error_like_torch_and_value_error(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        torch.amp.GradScaler("cpu", **kwargs)
    with pytest.raises(AssertionError, match=match):
        mixprec.GradScaler("cpu", **kwargs)
    with pytest.raises(ValueError, match=match):  # and a ValueError, as a config error should be
        mixprec.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
        ({"min_scale": 0.0}, "min_scale must be > 0"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "below min_scale"),
        ({"on_floor": "explode"}, "on_floor must be 'raise', 'warn' or 'skip'"),
        ({"init_scale": 1.0, "min_scale": 2.0}, "init_scale .* is below min_scale"),
        ({"init_scale": 2.0**20, "max_scale": 2.0**10}, "init_scale .* is above max_scale"),
    ],
)
def test_bad_extension_arguments_say_what_is_allowed(kwargs, match):
    with pytest.raises(ScalerConfigError, match=match):
        mixprec.GradScaler("cpu", **kwargs)


def test_fp16_grads_refused_like_torch_when_disallowed_and_unscaled_by_default():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    for cls, kw in ((torch.amp.GradScaler, {}), (mixprec.GradScaler, {"allow_fp16_grads": False})):
        s = cls("cpu", init_scale=8.0, **kw)
        o = torch.optim.SGD([w], lr=0.1)
        s.scale(w.float().sum()).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            s.unscale_(o)
        w.grad = None
    s = mixprec.GradScaler("cpu", init_scale=8.0)
    o = torch.optim.SGD([w], lr=0.1)
    s.scale(w.float().sum()).backward()
    assert w.grad.dtype == torch.float16 and w.grad.tolist() == [8.0, 8.0, 8.0]
    s.unscale_(o)
    assert w.grad.tolist() == [1.0, 1.0, 1.0]


def test_cuda_scaler_without_cuda_disables_itself_with_torchs_warning():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling."):
        s = mixprec.GradScaler()
    assert not s.is_enabled() and s.get_scale() == 1.0


# ---------------------------------------------------------------- skip and record


def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged():
    for fused in (False, True):
        w, o = _param_and_opt(fused=fused, opt="adamw")
        s = mixprec.GradScaler("cpu")
        _one_step(s, w, o)
        before_w, before_state = w.detach().clone(), {k: v.clone() for k, v in o.state[w].items()}
        ret = _one_step(s, w, o, overflow=True)
        assert torch.equal(w, before_w)
        for k, v in o.state[w].items():
            assert torch.equal(v, before_state[k]), k
        assert s.was_skipped() and bool(s.last_skipped)
        if not fused:
            assert ret is None


def test_history_records_scale_used_and_skips_per_step():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    pattern = [False, False, True, False, False, False, True, True]
    for overflow in pattern:
        _one_step(s, w, o, overflow)
    h = s.history()
    assert h["skipped"].tolist() == pattern
    # 64 -> (2 clean) 128 -> skip 64 -> 2 clean 128 -> 1 clean -> skip 64 -> skip 32
    assert h["scale"].tolist() == [64, 64, 128, 64, 64, 128, 128, 64]
    assert h["step"].tolist() == list(range(8))
    assert int(s.skipped_steps) == 3
    assert s.get_scale() == 32.0


def test_was_skipped_needs_no_extra_sync_after_unfused_step(monkeypatch):
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu")
    _one_step(s, w, o, overflow=True)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("was_skipped() synced"))
    assert s.was_skipped() is True


def _forbid_host_reads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("host-device sync in a path that must not sync")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_fused_optimizer_step_never_reads_device_values_on_host(monkeypatch, opt_name):
    w, o = _param_and_opt(fused=True, opt=opt_name)
    s = mixprec.GradScaler("cpu", hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    loss = (w * 2.0).sum()
    _forbid_host_reads(monkeypatch)
    for overflow in (False, True, False):
        s.scale(loss).backward(retain_graph=True)
        if overflow:
            w.grad.fill_(float("inf"))
        s.unscale_(o)
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        s.step(o)
        s.update()
        o.zero_grad(set_to_none=True)
        _ = s.last_skipped, s.last_scale, s.skipped_steps
    monkeypatch.undo()
    assert s.history()["skipped"].tolist() == [False, True, False]


def test_share_skip_decision_makes_every_optimizer_skip_on_one_overflow():
    a, oa = _param_and_opt()
    b, ob = _param_and_opt()
    s = mixprec.GradScaler("cpu")
    s.scale((a * 2).sum() + (b * 3).sum()).backward()
    a.grad[0] = float("nan")
    for o in (oa, ob):
        s.unscale_(o)
    s.share_skip_decision([oa, ob])
    s.step(oa)
    s.step(ob)
    s.update()
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.ones(4))


# ---------------------------------------------------------------- hysteresis and bounds


class _Reference:
    """DeepSpeed's dynamic loss scaler rule, written out on Python floats."""

    def __init__(self, scale, interval, hysteresis, consecutive, min_scale=None, max_scale=None):
        self.scale, self.interval, self.h, self.consecutive = scale, interval, hysteresis, consecutive
        self.left, self.tracker = hysteresis, 0
        self.min, self.max = min_scale, max_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.left <= 1:
                self.scale = self.scale * 0.5 if self.min is None else max(self.scale * 0.5, self.min)
            else:
                self.left -= 1
            self.tracker = 0
            return
        if self.consecutive:
            self.left = self.h
        self.tracker += 1
        if self.tracker == self.interval:
            self.scale = self.scale * 2 if self.max is None else min(self.scale * 2, self.max)
            self.tracker = 0
            if not self.consecutive:
                self.left = self.h


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (2, True), (3, False), (3, True)])
def test_hysteresis_follows_deepspeed_rule_on_random_overflow_sequences(hysteresis, consecutive):
    rng = random.Random(hysteresis * 10 + consecutive)
    w, o = _param_and_opt()
    s = mixprec.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis,
        consecutive_hysteresis=consecutive, min_scale=2.0**4, max_scale=2.0**14,
    )
    ref = _Reference(2.0**10, 3, hysteresis, consecutive, 2.0**4, 2.0**14)
    seen_held = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # floor warnings are tested elsewhere
        for step in range(400):
            overflow = rng.random() < 0.3
            before = s.get_scale()
            _one_step(s, w, o, overflow)
            ref.update(overflow)
            assert s.get_scale() == ref.scale, f"step {step}"
            assert s.was_skipped() == overflow  # an overflow is always skipped, hysteresis or not
            seen_held += overflow and s.get_scale() == before
    if hysteresis > 1:
        assert seen_held > 5  # hysteresis actually held the scale on some overflows


def test_min_scale_stops_the_collapse_that_torch_allows():
    w, o = _param_and_opt()
    t = torch.amp.GradScaler("cpu", init_scale=4.0)
    s = mixprec.GradScaler("cpu", init_scale=4.0, min_scale=1.0, on_floor="skip")
    for _ in range(200):
        _one_step(t, w, o, overflow=True)
        _one_step(s, w, o, overflow=True)
    assert t.get_scale() == 0.0  # torch: repeated backoff reaches 0 (pytorch#99640)
    assert s.get_scale() == 1.0


def test_max_scale_caps_growth():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, max_scale=32.0)
    for _ in range(10):
        _one_step(s, w, o)
    assert s.get_scale() == 32.0


def test_on_floor_raise_raises_once_the_floor_overflows():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu", init_scale=4.0, min_scale=2.0, on_floor="raise")
    _one_step(s, w, o, overflow=True)  # 4 -> 2, not at the floor yet
    with pytest.raises(mixprec.ScaleFloorError, match="already at its floor \\(min_scale=2\\)"):
        _one_step(s, w, o, overflow=True)


def test_on_floor_warn_warns_and_keeps_skipping():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_floor="warn")
    with pytest.warns(RuntimeWarning, match="already at its floor"):
        _one_step(s, w, o, overflow=True)
    assert s.get_scale() == 2.0 and s.was_skipped()


def test_on_floor_with_fused_optimizer_is_reported_at_the_next_read():
    w, o = _param_and_opt(fused=True, opt="adamw")
    s = mixprec.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_floor="raise")
    _one_step(s, w, o, overflow=True)  # fused: no sync in update, so no raise yet
    with pytest.raises(mixprec.ScaleFloorError):
        s.get_scale()


# ---------------------------------------------------------------- state


def _train(s, w, o, pattern):
    for overflow in pattern:
        _one_step(s, w, o, overflow)


def test_state_dict_round_trip_continues_bit_for_bit():
    pattern = [random.Random(3).random() < 0.3 for _ in range(60)]
    kwargs = dict(init_scale=2.0**8, growth_interval=3, hysteresis=2, min_scale=1.0, on_floor="skip")
    w1, o1 = _param_and_opt(opt="adamw")
    s1 = mixprec.GradScaler("cpu", **kwargs)
    _train(s1, w1, o1, pattern)

    w2, o2 = _param_and_opt(opt="adamw")
    s2 = mixprec.GradScaler("cpu", **kwargs)
    _train(s2, w2, o2, pattern[:25])
    saved = pickle.dumps({"s": s2.state_dict(), "o": o2.state_dict(), "w": w2.detach().clone()})
    loaded = pickle.loads(saved)
    w3 = torch.nn.Parameter(loaded["w"])
    o3 = torch.optim.AdamW([w3], lr=0.1)
    o3.load_state_dict(loaded["o"])
    s3 = mixprec.GradScaler("cpu")
    s3.load_state_dict(loaded["s"])
    _train(s3, w3, o3, pattern[25:])
    assert torch.equal(w1, w3)
    assert s1.state_dict() == s3.state_dict()


def test_state_dict_interchanges_with_torch_gradscaler():
    w, o = _param_and_opt()
    t = torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_interval=5)
    _train(t, w, o, [False, True, False, False])
    m = mixprec.GradScaler("cpu")
    m.load_state_dict(t.state_dict())
    assert m.get_scale() == t.get_scale() and m._get_growth_tracker() == t._get_growth_tracker()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(m.state_dict())  # torch ignores the "mixprec" extras
    assert back.state_dict() == t.state_dict()


def test_load_empty_state_dict_raises_like_torch():
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        mixprec.GradScaler("cpu").load_state_dict({})


def test_pickle_between_iterations_and_refuse_mid_iteration():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu", init_scale=32.0, hysteresis=2)
    _train(s, w, o, [True, False])
    clone = pickle.loads(pickle.dumps(s))
    assert clone.get_scale() == s.get_scale() == 32.0
    _one_step(clone, w, o)
    s.scale(w.sum()).backward()
    s.unscale_(o)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(s)


def test_disabled_scaler_is_a_no_op_like_torch():
    s = mixprec.GradScaler("cpu", enabled=False)
    x = torch.ones(2, requires_grad=True)
    assert s.scale(x) is x and s.get_scale() == 1.0 and s.state_dict() == {}
    w, o = _param_and_opt()
    w.grad = torch.ones(4)
    s.step(o)
    assert torch.equal(w, torch.full((4,), 0.9))


def test_scale_accepts_nested_iterables_like_torch():
    s = mixprec.GradScaler("cpu", init_scale=4.0)
    out = s.scale([torch.ones(1), (torch.ones(1) * 2,)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].item() == 4.0 and out[1][0].item() == 8.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        s.scale(3.0)


def test_update_new_scale_sets_the_scale_and_validates_like_torch():
    w, o = _param_and_opt()
    s = mixprec.GradScaler("cpu")
    _one_step(s, w, o)
    s.update(128.0)
    assert s.get_scale() == 128.0
    with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
        s.update(torch.ones(2))


def test_is_an_instance_of_torch_gradscaler():
    assert isinstance(mixprec.GradScaler("cpu"), torch.amp.GradScaler)


# ---------------------------------------------------------------- static and no-op


def test_static_scaler_never_changes_scale_but_skips_overflows():
    w, o = _param_and_opt()
    s = mixprec.StaticLossScaler(2.0**10, device="cpu")
    _train(s, w, o, [False] * 5 + [True] * 3)
    assert s.get_scale() == 1024.0
    assert s.history()["skipped"].tolist() == [False] * 5 + [True] * 3
    for bad in (0.0, -1.0, float("nan"), "128", True):
        with pytest.raises(ScalerConfigError, match="scale > 0"):
            mixprec.StaticLossScaler(bad, device="cpu")


def test_noop_scaler_passes_everything_through():
    w, o = _param_and_opt()
    s = mixprec.NoOpScaler()
    loss = (w * 2).sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(o)
    s.step(o)
    s.update()
    assert w.grad.tolist() == [2.0] * 4 and not s.is_enabled() and not s.was_skipped()
