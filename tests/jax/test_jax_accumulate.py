"""Gradient accumulation in skip_nonfinite (every_k), and the nestings that silently break it: optax.MultiSteps
around it stalls after one overflow (refused), a chain with a transformation before it reads the scaled gradient
(refused)."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402

W = jnp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2) / 6)


def _batches(n, poison=()):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.standard_normal((4, 3)).astype(np.float32)
        out.append((jnp.asarray(x), jnp.asarray(x @ np.ones((3, 2), np.float32)), jnp.float32(np.inf if i in poison else 1.0)))
    return out


def _make_step(tx):
    @jax.jit
    def step(params, state, x, y, poison):
        ls = mpj.loss_scale_of(state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((x @ p["w"] - y) ** 2) * poison))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def test_every_k_steps_once_per_window_with_the_mean_gradient():
    k = 4
    tx = mpj.skip_nonfinite(optax.sgd(0.1), mpj.DynamicLossScale(jnp.float32(2.0**10)), every_k=k)
    step = _make_step(tx)
    params = {"w": W}
    state = tx.init(params)
    batches = _batches(k)
    for i, (x, y, poison) in enumerate(batches):
        before = params
        params, state = step(params, state, x, y, poison)
        if i < k - 1:
            assert np.array_equal(params["w"], before["w"])  # within the window: bitwise unchanged
            assert int(state.accumulation.count) == i + 1
    mean = sum(jax.grad(lambda p, x=x, y=y: jnp.mean((x @ p["w"] - y) ** 2))({"w": W})["w"] for x, y, _ in batches) / k
    np.testing.assert_allclose(params["w"], W - 0.1 * mean, rtol=1e-6, atol=1e-7)
    assert int(state.skipped) == 0 and int(state.accumulation.count) == 0
    assert float(state.loss_scale.loss_scale) == 2.0**10 and int(state.loss_scale.counter) == 1  # one step counted


def test_a_window_with_an_overflow_is_discarded_whole_and_the_next_starts_clean():
    """The failure optax.MultiSteps(skip_nonfinite(...)) has: after the overflow every window stays NaN. Here
    window 1 (an inf in micro-batch 2) is skipped once, the scale lowered once, and windows 2 and 3 step."""
    k = 4
    tx = mpj.skip_nonfinite(optax.sgd(0.1), mpj.DynamicLossScale(jnp.float32(2.0**10)), every_k=k)
    step = _make_step(tx)
    params = {"w": W}
    state = tx.init(params)
    scales, changed = [], []
    for i, (x, y, poison) in enumerate(_batches(3 * k, poison={1})):
        before = params["w"]
        params, state = step(params, state, x, y, poison)
        scales.append(float(state.loss_scale.loss_scale))
        changed.append(not np.array_equal(params["w"], before))
    assert changed == [False] * 3 + [False] + [False] * 3 + [True] + [False] * 3 + [True]
    assert scales[:3] == [1024.0] * 3 and scales[3:] == [512.0] * 9  # fixed in the window, lowered at its end
    assert int(state.skipped) == 1 and np.isfinite(params["w"]).all()
    assert np.isfinite(state.accumulation.grads["w"]).all()


def test_multisteps_around_skip_nonfinite_is_refused():
    params = {"w": W}
    with pytest.raises(ValueError, match="MultiSteps.*stalls.*every_k"):
        optax.MultiSteps(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed"), 4).init(params)
    state = mpj.skip_nonfinite(optax.MultiSteps(optax.sgd(0.1), 4), "fp16-mixed").init(params)  # the nesting that works
    assert float(mpj.loss_scale_of(state).loss_scale) == 2.0**16


def test_multisteps_stall_is_also_caught_when_reading_the_scale():
    """A state built around the init check (a MultiStepsState holding ours) is refused where the loss scale is read."""
    inner = mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed").init({"w": W})
    fake = optax.MultiStepsState(mini_step=jnp.zeros([], jnp.int32), gradient_step=jnp.zeros([], jnp.int32),
                                 inner_opt_state=inner, acc_grads={"w": jnp.zeros_like(W)}, skip_state=())
    with pytest.raises(ValueError, match="stalls"):
        mpj.loss_scale_of(fake)


@pytest.mark.parametrize("build", [
    lambda s: optax.chain(optax.clip_by_global_norm(1.0), s),
    lambda s: optax.chain(optax.add_decayed_weights(1e-4), optax.chain(s)),
    lambda s: optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("opt", s)),
])
def test_skip_nonfinite_after_another_transformation_in_a_chain_is_refused(build):
    with pytest.raises(ValueError, match="outermost.*SCALED gradient"):
        build(mpj.skip_nonfinite(optax.adam(1e-3), "fp16-mixed")).init({"w": W})


def test_skip_nonfinite_alone_in_a_chain_is_fine():
    # with a transformation after it, it is refused (tests/jax/test_jax_probe.py): that one would run on skipped steps
    tx = optax.chain(mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "fp16-mixed"))
    assert float(mpj.loss_scale_of(tx.init({"w": W})).loss_scale) == 2.0**16


def test_every_k_under_scan_equals_the_python_loop_bitwise():
    tx = mpj.skip_nonfinite(optax.adam(1e-2), "fp16-mixed", every_k=3)
    step = _make_step(tx)
    batches = _batches(9, poison={4})
    params, state = {"w": W}, tx.init({"w": W})
    for b in batches:
        params, state = step(params, state, *b)
    xs = tuple(jnp.stack(c) for c in zip(*batches))
    (p2, s2), _ = jax.lax.scan(lambda c, b: (step(*c, *b), None), ({"w": W}, tx.init({"w": W})), xs)
    for a, b in zip(jax.tree_util.tree_leaves((params, state)), jax.tree_util.tree_leaves((p2, s2))):
        np.testing.assert_array_equal(a, b)
    assert int(state.skipped) == 1


@pytest.mark.parametrize("every_k", [0, -1, 2.0, True])
def test_bad_every_k_is_refused(every_k):
    with pytest.raises(ValueError, match="every_k must be an integer >= 1"):
        mpj.skip_nonfinite(optax.sgd(0.1), every_k=every_k)


def test_fp8_delayed_history_advances_once_per_window():
    from mixprec.jax import fp8

    cfg = fp8.Fp8Config(scaling="delayed", amax_history_len=2)
    meta = fp8.Fp8Meta.init(cfg)
    tx = mpj.skip_nonfinite(optax.sgd(0.1), every_k=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)

    @jax.jit
    def step(meta, state, amax):
        _, state = tx.update({"w": jnp.ones(2)}, state, params)
        observed = fp8.Fp8Meta(jnp.zeros((2, 3)).at[0].set(amax), jnp.zeros(3), cfg)
        return fp8.update(meta, observed, state), state

    for amax in (3.0, 5.0):  # two micro-batches: one slot, raised to the larger amax, then one roll
        meta, state = step(meta, state, amax)
    np.testing.assert_array_equal(meta.amax_history, [[0, 0, 0], [5, 5, 5]])
    np.testing.assert_array_equal(meta.scale, np.float32([448, 448, 57344]) / np.float32(5))


@pytest.mark.parametrize("build", [
    lambda: mpj.skip_nonfinite(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed"), "fp16-mixed"),
    lambda: mpj.skip_nonfinite(optax.chain(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed"), optax.scale(1.0)), "fp16-mixed"),
])
def test_skip_nonfinite_inside_skip_nonfinite_is_refused(build):
    # found by a probe: accepted, and the gradient was unscaled twice (a true gradient of 1 gave an update of
    # -1.5e-6 instead of -0.1), while loss_scale_of handed out the outer scale only
    with pytest.raises(ValueError, match="nested inside another skip_nonfinite.*unscaled twice"):
        build().init({"w": W})


def test_two_skip_nonfinite_partitions_are_named_when_reading_the_scale():
    # a skip_nonfinite as a partition of multi_transform is refused at init (test_jax_probe.py); a state holding two
    # (put together by hand, or by a combinator the init check does not know) is named when read
    state = {"a": mpj.skip_nonfinite(optax.adam(1e-3), "fp16-mixed").init({"w": W}),
             "b": mpj.skip_nonfinite(optax.sgd(1e-3), "fp16-mixed").init({"v": W})}
    with pytest.raises(ValueError, match=r"holds 2 skip_nonfinite states \(at .*\['a'\].*\).*wrap the whole optimizer "
                                         r"once.*multi_transform"):
        mpj.loss_scale_of(state)
    with pytest.raises(ValueError, match="holds no skip_nonfinite state"):
        mpj.loss_scale_of(optax.adam(1e-3).init({"w": W}))
