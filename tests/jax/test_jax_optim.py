"""skip_nonfinite: unscale, check, adjust and commit-or-skip inside one jitted step; scan equals a Python
loop bit for bit; a checkpoint resumes bit for bit. One step function is compiled for the module."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax  # noqa: E402
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.jax.optim import SkipNonFiniteState  # noqa: E402

POLICY = mpj.get_policy("p=f32,c=f16,o=f32")


def _init_params():
    rng = np.random.default_rng(0)  # numpy: an eager jax.random draw compiles a kernel per shape
    return {"w1": jnp.asarray(rng.standard_normal((8, 16), np.float32) * 0.3),
            "w2": jnp.asarray(rng.standard_normal((16, 4), np.float32) * 0.3),
            "b": jnp.array([-0.0, 0.0, 1.0, -2.0])}


def _batch(i):
    key = jax.random.fold_in(jax.random.PRNGKey(7), i)
    return jax.random.normal(key, (4, 8)), jax.random.normal(jax.random.fold_in(key, 1), (4, 4))


def _loss(params, x, y):
    p, x = POLICY.cast_to_compute((params, x))
    out = POLICY.cast_to_output(jax.nn.relu(x @ p["w1"]) @ p["w2"] + p["b"])
    return jnp.mean((out - y) ** 2)


TX = mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                        mpj.DynamicLossScale(jnp.float32(2.0**12), period=4))


def _body(carry, i, poison):
    params, state = carry
    x, y = _batch(i)
    ls = mpj.loss_scale_of(state)
    loss, grads = jax.value_and_grad(lambda p: ls.scale(_loss(p, x, y)) * poison)(params)
    updates, state = TX.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), (loss, ls.loss_scale, state.last_skipped)


STEP = jax.jit(_body)


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def planted():
    """Six steps with an overflow planted at step 3 (index 2): the carries before and after every step."""
    carry = (_init_params(), None)
    carry = (carry[0], TX.init(carry[0]))
    history = [carry]
    outs = []
    for i in range(6):
        carry, out = STEP(carry, jnp.int32(i), jnp.float32(jnp.inf if i == 2 else 1.0))
        history.append(carry)
        outs.append(out)
    return history, outs


def test_planted_overflow_skips_exactly_that_step_and_halves_the_scale(planted):
    history, outs = planted
    skipped = [bool(o[2]) for o in outs]
    assert skipped == [False, False, True, False, False, False]
    scales = [float(h[1].loss_scale.loss_scale) for h in history]
    assert scales == [2.0**12, 2.0**12, 2.0**12, 2.0**11, 2.0**11, 2.0**11, 2.0**11]  # period 4 restarts at the skip
    assert [int(h[1].skipped) for h in history] == [0, 0, 0, 1, 1, 1, 1]


def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged(planted):
    history, _ = planted
    before, after = history[2], history[3]
    assert _bits(after[0]) == _bits(before[0])                     # params, -0.0 included
    assert _bits(after[1].inner_state) == _bits(before[1].inner_state)  # Adam's moments and count
    for i in (1, 3):  # the steps around it moved the parameters
        assert _bits(history[i + 1][0]) != _bits(history[i][0])


def test_skipped_updates_are_the_additive_identity():
    state = TX.init({"w": jnp.array([-0.0, 0.0, 1.5])})
    updates, _ = jax.jit(TX.update)({"w": jnp.array([jnp.nan, 1.0, 1.0])}, state, {"w": jnp.array([-0.0, 0.0, 1.5])})
    applied = optax.apply_updates({"w": jnp.array([-0.0, 0.0, 1.5])}, updates)["w"]
    assert np.asarray(applied).tobytes() == np.array([-0.0, 0.0, 1.5], np.float32).tobytes()


@pytest.fixture(scope="module")
def hundred():
    """100 steps as a Python loop over the jitted step, with an overflow every 17 steps; the state at 50."""
    params = _init_params()
    carry = (params, TX.init(params))
    poisons = jnp.where(jnp.arange(100) % 17 == 16, jnp.inf, 1.0).astype(jnp.float32)
    at_50 = None
    for i in range(100):
        carry, _ = STEP(carry, jnp.int32(i), poisons[i])
        if i == 49:
            at_50 = carry
    return carry, at_50, poisons


def test_lax_scan_over_100_steps_equals_the_python_loop_bitwise(hundred):
    looped, _, poisons = hundred
    params = _init_params()
    scanned, (losses, scales, skipped) = jax.jit(
        lambda c: jax.lax.scan(lambda c, xs: _body(c, *xs), c, (jnp.arange(100, dtype=jnp.int32), poisons))
    )((params, TX.init(params)))
    assert _bits(scanned) == _bits(looped)
    assert bool(skipped[poisons == jnp.inf].all())  # the five planted overflows, and the scaler's own probing
    assert int(skipped.sum()) == int(looped[1].skipped) > 5


def test_resume_from_a_saved_pytree_continues_bitwise(hundred, tmp_path):
    final, at_50, poisons = hundred
    mpj.save_tree(tmp_path / "ckpt.npz", at_50)
    params = _init_params()
    fresh = (params, TX.init(params))  # the template: same optimizer and loss-scale configuration
    carry = mpj.load_tree(tmp_path / "ckpt.npz", fresh)
    for i in range(50, 100):
        carry, _ = STEP(carry, jnp.int32(i), poisons[i])
    assert _bits(carry) == _bits(final)


def test_gradients_are_unscaled_before_the_inner_clip():
    """The clip inside the wrapper sees true gradients: scaled gradients would be clipped 1024x harder."""
    tx = mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), mpj.StaticLossScale(1024.0))
    params = {"w": jnp.zeros(2)}
    true_grads = {"w": jnp.array([0.3, 0.4])}  # norm 0.5: under the clip
    updates, _ = tx.update(jax.tree_util.tree_map(lambda g: g * 1024.0, true_grads), tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.3, -0.4], rtol=1e-6)


def test_no_loss_scale_still_skips_non_finite_steps():
    tx = mpj.skip_nonfinite(optax.sgd(0.1), "bf16-mixed")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert isinstance(state.loss_scale, mpj.NoOpLossScale)
    updates, state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, state, params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [1.0, 1.0] and int(mpj.skipped_steps_of(state)) == 1


def test_loss_scale_of_finds_the_state_inside_a_chain():
    tx = optax.chain(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed"))  # alone: with others beside it, refused (nesting)
    state = tx.init({"w": jnp.ones(2)})
    assert float(mpj.loss_scale_of(state).loss_scale) == 2.0**16
    with pytest.raises(ValueError, match="holds no skip_nonfinite state"):
        mpj.loss_scale_of(optax.sgd(0.1).init({"w": jnp.ones(2)}))


def test_recipe_name_and_bad_spec():
    assert isinstance(mpj.skip_nonfinite(optax.sgd(0.1), "fp16-mixed").init({"w": jnp.ones(1)}), SkipNonFiniteState)
    with pytest.raises(TypeError, match="recipe .* loss scale"):
        mpj.skip_nonfinite(optax.sgd(0.1), 2.0**16)
    with pytest.raises(ValueError, match="Unknown recipe"):
        mpj.skip_nonfinite(optax.sgd(0.1), "fp17-mixed")


def test_an_optimizer_state_that_changes_dtype_gets_an_explanation():
    """16-bit parameters give a 16-bit Adam state; the unscaled fp32 gradients would change it."""
    tx = mpj.skip_nonfinite(optax.adam(1e-3), mpj.StaticLossScale(np.float32(8.0)))
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(TypeError, match="keep fp32 parameters in the optimizer"):
        tx.update({"w": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)


def test_the_state_survives_vmap_over_independent_models():
    """An ensemble of two models under vmap (no axis_name: each decides for itself, as it should)."""
    tx = mpj.skip_nonfinite(optax.sgd(0.5), mpj.DynamicLossScale(jnp.float32(2.0**4)))
    params = {"w": jnp.ones((2, 3))}  # two members
    state = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[1.0, 1.0, 1.0], [1.0, jnp.inf, 1.0]])}
    updates, state = jax.jit(jax.vmap(tx.update))(grads, state, params)
    new = optax.apply_updates(params, updates)["w"]
    assert state.last_skipped.tolist() == [False, True] and state.loss_scale.loss_scale.tolist() == [16.0, 8.0]
    assert new[1].tolist() == [1.0, 1.0, 1.0] and new[0].tolist() != [1.0, 1.0, 1.0]
