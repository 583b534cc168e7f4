"""flax.serialization of every mixprec.jax state: the loss scales, skip_nonfinite's state (with an accumulation
window), fp8's Fp8Meta, and a linen TrainState with tx=skip_nonfinite(...) that resumes bit for bit."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")
serialization = pytest.importorskip("flax.serialization")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.jax import fp8  # noqa: E402


def _same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _dynamic(scale=2.0**12):
    return mpj.DynamicLossScale(jnp.float32(scale), min_loss_scale=jnp.float32(2.0**-4), max_loss_scale=2.0**20,
                                hysteresis=2)


STATES = {
    "noop": lambda: mpj.NoOpLossScale(),
    "static": lambda: mpj.StaticLossScale(np.float32(1024.0)),
    "dynamic": lambda: _dynamic().adjust(jnp.asarray(False)),
    "fp8_meta": lambda: fp8.update(fp8.Fp8Meta.init(fp8.Fp8Config(scaling="delayed", amax_history_len=4)),
                                   fp8.Fp8Meta(jnp.ones((4, 3)), jnp.zeros(3),
                                               fp8.Fp8Config(scaling="delayed", amax_history_len=4))),
    "skip_state_every_k": lambda: mpj.skip_nonfinite(optax.adam(1e-3), _dynamic(), every_k=2).update(
        {"w": jnp.ones(3)}, mpj.skip_nonfinite(optax.adam(1e-3), _dynamic(), every_k=2).init({"w": jnp.ones(3)}),
        {"w": jnp.ones(3)})[1],
}
FRESH = {
    "noop": lambda: mpj.NoOpLossScale(),
    "static": lambda: mpj.StaticLossScale(np.float32(1.0)),
    "dynamic": lambda: _dynamic(1.0),
    "fp8_meta": lambda: fp8.Fp8Meta.init(fp8.Fp8Config(scaling="delayed", amax_history_len=4)),
    "skip_state_every_k": lambda: mpj.skip_nonfinite(optax.adam(1e-3), _dynamic(), every_k=2).init({"w": jnp.ones(3)}),
}


@pytest.mark.parametrize("kind", sorted(STATES))
def test_to_bytes_round_trips(kind):
    state = STATES[kind]()
    restored = serialization.from_bytes(FRESH[kind](), serialization.to_bytes(state))
    _same(restored, state)
    if kind == "static":
        assert float(restored.loss_scale) == 1024.0


def test_another_configuration_is_refused_naming_it():
    data = serialization.to_bytes(_dynamic())
    other = mpj.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(2.0**-4), max_loss_scale=2.0**20,
                                 hysteresis=3)
    with pytest.raises(ValueError, match="hysteresis"):
        serialization.from_bytes(other, data)


SCALES = {"noop": "NoOpLossScale", "static": "StaticLossScale", "dynamic": "DynamicLossScale"}


@pytest.mark.parametrize("saved", sorted(SCALES))
@pytest.mark.parametrize("target", sorted(SCALES))
def test_a_loss_scale_of_another_kind_is_refused_naming_both(saved, target):
    # found by qa: an fp16-mixed state (DynamicLossScale) restored into a bf16-mixed one (NoOpLossScale) loaded
    # without a word and dropped the scale; a static scale took a dynamic one's value; the reverse gave KeyError
    if saved == target:
        return
    data = serialization.to_bytes(STATES[saved]())
    with pytest.raises(ValueError, match=rf"the saved loss scale is a {SCALES[saved]}, the target's a "
                                         rf"{SCALES[target]}: build the target with the recipe"):
        serialization.from_bytes(FRESH[target](), data)
    wrapped = mpj.skip_nonfinite(optax.sgd(0.1), STATES[saved]())  # the same inside skip_nonfinite's state
    into = mpj.skip_nonfinite(optax.sgd(0.1), FRESH[target]())
    with pytest.raises(ValueError, match=f"the saved loss scale is a {SCALES[saved]}"):
        serialization.from_bytes(into.init({"w": jnp.ones(3)}), serialization.to_bytes(wrapped.init({"w": jnp.ones(3)})))


def test_a_linen_train_state_with_skip_nonfinite_resumes_bit_for_bit():
    from flax import linen as nn
    from flax.training import train_state

    model = nn.Dense(4, dtype=jnp.float16)
    x, y = jnp.ones((8, 3)), jnp.zeros((8, 4))
    tx = mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), "fp16-mixed", every_k=2)

    def fresh():
        return train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x)["params"],
                                             tx=tx)

    @jax.jit
    def step(state, poison):
        ls = mpj.loss_scale_of(state.opt_state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2) * poison))(state.params)
        return state.apply_gradients(grads=grads)

    state = fresh()
    for i in range(5):
        state = step(state, jnp.float32(np.inf if i == 1 else 1.0))
    data = serialization.to_bytes(state)
    resumed = serialization.from_bytes(fresh(), data)
    for _ in range(4):
        state, resumed = step(state, jnp.float32(1.0)), step(resumed, jnp.float32(1.0))
    _same(resumed.params, state.params)
    _same(resumed.opt_state, state.opt_state)
    assert int(mpj.skipped_steps_of(state.opt_state)) == 1


def test_mixprec_jax_imports_without_flax():
    from mixprec_test_env import src_env

    code = ("import sys\n"
            "class _NoFlax:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'flax':\n"
            "            raise ImportError('blocked')\n"
            "sys.meta_path.insert(0, _NoFlax())\n"
            "import mixprec.jax as mpj, jax.numpy as jnp\n"
            "print(float(mpj.DynamicLossScale(jnp.float32(4.0)).adjust(jnp.asarray(False)).loss_scale), 'flax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=src_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0", "False"]
