"""What a probe of skip_nonfinite among optax's combinators, donated jitted steps and bad input found (each test
failed before its fix), and the combinations it checked that work (kept so that they keep working)."""

import warnings

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402

W = jnp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2) / 6)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _data(n, poison=()):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8, 3)).astype(np.float32)
    y = rng.standard_normal((n, 8, 2)).astype(np.float32)
    p = np.where(np.isin(np.arange(n), poison), np.inf, 1.0).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(p)


def _step(tx):
    def step(carry, batch):
        params, state = carry
        x, y, poison = batch
        ls = mpj.loss_scale_of(state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((x @ p["w"] - y) ** 2) * poison))(params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

    return step


# --- donated steps -------------------------------------------------------------------------------------------------


def test_init_after_a_donated_step_builds_a_live_state_and_the_run_resumes_bitwise(tmp_path):
    # found by a probe: every init handed out the loss scale's own arrays, so a step jitted with donate_argnums
    # deleted them at its first call and each later init (the `like` of a resume) raised "Array has been deleted"
    scale = mpj.DynamicLossScale(jnp.float16(2.0**14), period=3, hysteresis=2, min_loss_scale=jnp.float16(2.0**-8))
    tx = mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), scale, every_k=2)
    step = _step(tx)
    x, y, poison = _data(16, poison=(3, 8, 9))
    params = {"w": W}
    (want_params, want_state), _ = jax.jit(lambda c, b: jax.lax.scan(step, c, b))((params, tx.init(params)), (x, y, poison))

    donated = jax.jit(lambda c, b: step(c, b)[0], donate_argnums=0)
    carry = ({"w": jnp.copy(W)}, tx.init(params))  # the parameters are donated: not the module's W
    for i in range(7):
        carry = donated(carry, (x[i], y[i], poison[i]))
    assert not scale.loss_scale.is_deleted()  # the loss scale given to skip_nonfinite is not the state's
    mpj.save_tree(tmp_path / "mid.npz", carry)
    carry = mpj.load_tree(tmp_path / "mid.npz", ({"w": jnp.zeros_like(W)}, tx.init(params)))
    for i in range(7, 16):
        carry = donated(carry, (x[i], y[i], poison[i]))
    assert _bits(carry) == _bits((want_params, want_state))
    assert int(want_state.skipped) == 2  # windows [2, 3] and [8, 9]


# --- where skip_nonfinite sits among optax's combinators -------------------------------------------------------------


@pytest.mark.parametrize("build", [
    lambda s: optax.chain(s, optax.add_decayed_weights(0.1)),
    lambda s: optax.chain(optax.chain(s), optax.scale_by_schedule(optax.linear_schedule(1.0, 0.0, 10))),
    lambda s: optax.named_chain(("opt", s), ("wd", optax.add_decayed_weights(0.1))),
])
def test_transformations_after_it_in_a_chain_are_refused(build):
    # found by a probe: accepted, and a skipped step moved the parameters (add_decayed_weights turned the -0.0
    # updates into -0.1 * p) and advanced the schedule's count
    with pytest.raises(ValueError, match="outermost.*before 1 other.*skipped ones included"):
        build(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed")).init({"w": W})


def test_inject_hyperparams_around_it_is_refused_and_inside_it_holds_the_schedule():
    # found by a probe: inject_hyperparams around the wrapper advanced its count on the skipped step (the next step
    # used the second learning rate of the schedule)
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    outside = optax.inject_hyperparams(lambda learning_rate: mpj.skip_nonfinite(optax.sgd(learning_rate), "fp16-mixed"))
    with pytest.raises(ValueError, match="inside optax.inject_hyperparams.*skipped steps included"):
        outside(learning_rate=schedule).init({"w": W})

    tx = mpj.skip_nonfinite(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), "fp16-mixed")
    step = jax.jit(_step(tx))
    x, y, poison = _data(3, poison=(0,))
    carry = ({"w": W}, tx.init({"w": W}))
    for i in range(3):
        carry, _ = step(carry, (x[i], y[i], poison[i]))
    state = carry[1]
    assert int(state.skipped) == 1 and int(state.inner_state.count) == 2  # two steps taken: two counted
    np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"], 0.9, rtol=1e-6)  # the second step's


@pytest.mark.parametrize("build", [
    lambda s: optax.masked(s, {"w": True, "v": False}),
    lambda s: optax.multi_transform({"train": s, "other": optax.sgd(0.1)}, {"w": "train", "v": "other"}),
    lambda s: optax.multi_transform({"train": s, "frozen": optax.set_to_zero()}, {"w": "train", "v": "frozen"}),
])
def test_it_inside_masked_or_one_partition_is_refused(build):
    # found by a probe: accepted; the other partition's sgd stepped with the scaled gradient (v went from 1 to -6552
    # in one step of lr 0.1), masked passed it through as the update, and neither was checked for finiteness
    with pytest.raises(ValueError, match="inside optax.masked.*SCALED gradient.*multi_transform"):
        build(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed")).init({"w": W, "v": W})


def test_multi_transform_inside_it_freezes_and_trains_with_unscaled_gradients():
    tx = mpj.skip_nonfinite(optax.multi_transform({"train": optax.sgd(0.5), "frozen": optax.set_to_zero()},
                                                  {"w": "train", "v": "frozen"}), mpj.StaticLossScale(1024.0))
    params = {"w": jnp.ones(2), "v": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.full(2, 1024.0), "v": jnp.full(2, 1024.0)}, state, params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [0.5, 0.5]
    assert optax.apply_updates(params, updates)["v"].tolist() == [1.0, 1.0]
    updates, state = tx.update({"w": jnp.full(2, 1024.0), "v": jnp.array([jnp.inf, 0.0])}, state, params)
    assert int(state.skipped) == 1 and optax.apply_updates(params, updates)["w"].tolist() == [1.0, 1.0]


def test_apply_if_finite_around_it_is_refused_and_inside_it_is_harmless():
    # found by a probe: accepted; apply_if_finite rejected the overflowing (scaled) step itself and kept the wrapper's
    # state, so the loss scale was not lowered and the skip was not counted
    with pytest.raises(ValueError, match="inside optax.apply_if_finite.*loss scale is never lowered"):
        optax.apply_if_finite(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed"), 5).init({"w": W})
    tx = mpj.skip_nonfinite(optax.apply_if_finite(optax.sgd(0.1), 5), "fp16-mixed")
    params = {"w": jnp.ones(2)}
    updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, tx.init(params), params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [1.0, 1.0]
    assert int(state.skipped) == 1 and float(state.loss_scale.loss_scale) == 2.0**15


def test_multisteps_inside_it_accumulates_unscaled_gradients_and_drops_a_non_finite_micro_batch():
    # the other order than the refused MultiSteps(skip_nonfinite(...)): here the scale is adjusted per micro-batch
    # and a skip is counted per micro-batch (every_k adjusts and counts once per window)
    tx = mpj.skip_nonfinite(optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(),
                            mpj.DynamicLossScale(jnp.float32(8.0)))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    seen = []
    for g in (1.0, np.inf, 3.0, 5.0, 7.0):
        scale = mpj.loss_scale_of(state).loss_scale
        updates, state = tx.update({"w": jnp.full(2, g) * scale}, state, params)
        params = optax.apply_updates(params, updates)
        seen.append(float(params["w"][0]))
    assert seen == [0.0, 0.0, -2.0, -2.0, -8.0]  # means (1 + 3) / 2 and (5 + 7) / 2; the inf micro-batch dropped
    assert int(state.skipped) == 1 and float(state.loss_scale.loss_scale) == 4.0


def test_the_inner_clip_sees_the_unscaled_gradient_bitwise_as_an_fp32_run():
    """Scaling by a power of two is exact in fp32 (no overflow or underflow here), through the backward pass and the
    unscaling: the clip inside the wrapper must see exactly the fp32 run's gradient, so the runs agree bit for bit. A
    clip of the scaled gradient, or an unscaling done twice, would differ by orders of magnitude."""
    make = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))  # noqa: E731
    tx, ref = mpj.skip_nonfinite(make(), mpj.DynamicLossScale(jnp.float32(2.0**16), period=2)), make()
    x, y, poison = _data(6)
    loss = lambda p, i: jnp.mean((x[i] @ p["w"] - y[i]) ** 2)  # noqa: E731
    assert float(optax.tree.norm(jax.grad(loss)({"w": W}, 0))) > 0.5  # the clip is active
    params, state, ref_params, ref_state = {"w": W}, tx.init({"w": W}), {"w": W}, ref.init({"w": W})
    for i in range(6):
        (params, state), _ = _step(tx)((params, state), (x[i], y[i], poison[i]))
        u, ref_state = ref.update(jax.grad(loss)(ref_params, i), ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    assert float(state.loss_scale.loss_scale) == 2.0**19  # grown three times: the scale changed along the way
    assert _bits(params) == _bits(ref_params)


# --- bad input -------------------------------------------------------------------------------------------------------


def test_a_python_int_dynamic_scale_is_float32_and_never_wraps():
    # found by a probe: DynamicLossScale(2**15) kept an int32 scale, whose growth wrapped past 2**31 to a negative
    # number and then to 0 (with no warning for a Python int)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Expected floating type" warning either: it is float32
        scale = mpj.DynamicLossScale(2**15, period=1)
    assert np.asarray(scale.loss_scale).dtype == np.float32
    adjust = jax.jit(lambda s: s.adjust(jnp.bool_(True)))
    for _ in range(20):
        scale = adjust(scale)
    assert float(scale.loss_scale) == 2.0**35
    with pytest.warns(UserWarning, match="Expected floating type"):  # jmp's warning, kept for an int array
        int_scale = mpj.DynamicLossScale(jnp.int32(2**29), period=1)
    for _ in range(4):
        int_scale = adjust(int_scale)
    assert int(int_scale.loss_scale) == 2**30  # growth stops at the integer maximum instead of wrapping
    with pytest.raises(TypeError, match="must be a float.*DynamicLossScale\\(jnp.float32"):
        mpj.skip_nonfinite(optax.sgd(0.1), int_scale)


@pytest.mark.parametrize("value", ["65536", None, True, [2.0**15]])
def test_a_dynamic_scale_that_is_not_a_number_is_refused(value):
    # found by a probe: a string gave "function <lambda> ... traced for jit returned a value of type <class 'str'>"
    with pytest.raises(TypeError, match="loss_scale must be a float scalar or array, e.g. jnp.float32"):
        mpj.DynamicLossScale(value)


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(0.1)])
@pytest.mark.parametrize("grads, fragment", [
    ({"w": jnp.ones(2)}, r"no gradient for \['b'\]"),
    ({"w": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}, r"gradients for \['c'\], which are not parameters"),
    ({"w": jnp.ones(1), "b": jnp.ones(3)}, r"gradient \['w'\] has shape \[1\], its parameter \[2\]"),
])
def test_gradients_that_do_not_match_the_parameters_are_named(inner, grads, fragment):
    # found by a probe: with sgd a (1,) gradient for a (2,) parameter gave a (1,) update that apply_updates broadcast,
    # and a missing one gave updates without it; with adam a bare pytree-structure error from inside optax
    tx = mpj.skip_nonfinite(inner, "fp16-mixed")
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    with pytest.raises(ValueError, match=fragment):
        jax.jit(tx.update)(grads, tx.init(params), params)


def test_gradients_in_another_node_type_with_the_same_leaves_are_accepted():
    from flax.core import FrozenDict  # flax is part of the jax extra

    tx = mpj.skip_nonfinite(optax.sgd(1.0), mpj.StaticLossScale(4.0))
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update(FrozenDict({"w": jnp.full(2, 4.0)}), tx.init(params), params)
    assert updates["w"].tolist() == [-1.0, -1.0]
