"""The seeds' two JAX programs ("Implementation, twice"), retyped: the manual bf16 dtype discipline and the
jmp version with ``import mixprec.jax as jmp``. The code is the seed's; the shapes are smaller and the data
is a fixed teacher problem (the seed's fresh random targets have nothing to learn) so training shows."""

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax  # noqa: E402
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

D_IN, D_HIDDEN = 32, 128  # the seed: 1024, 4096
_RNG = np.random.default_rng(42)
# numpy draws: each eager jax.random call of a new shape compiles a kernel, seconds on a busy CPU
X = _RNG.standard_normal((16, D_IN), np.float32)
Y = np.tanh(X @ (_RNG.standard_normal((D_IN, D_IN), np.float32) * 0.3))
W1, W2 = _RNG.standard_normal((D_IN, D_HIDDEN), np.float32), _RNG.standard_normal((D_HIDDEN, D_IN), np.float32)


def _data():
    return jnp.asarray(X), jnp.asarray(Y)


def test_manual_bf16_discipline_trains_with_fp32_params_and_grads():
    # fp32 params pytree: the master copy, owned by the optimizer (the seed draws them with jax.random).
    params = {"w1": jnp.asarray(W1 * 0.02), "w2": jnp.asarray(W2 * 0.02)}

    def forward(params, x):
        p = jax.tree.map(lambda t: t.astype(jnp.bfloat16), params)
        h = jax.nn.relu(x.astype(jnp.bfloat16) @ p["w1"])
        return (h @ p["w2"]).astype(jnp.float32)

    def loss_fn(params, x, y):
        return jnp.mean((forward(params, x) - y) ** 2)   # reduction in fp32

    opt = optax.adamw(3e-4 * 30)  # the seed's lr, scaled for 60 steps instead of 1000
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y = _data()
    grads = jax.jit(jax.grad(loss_fn))(params, x, y)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}  # cotangents cast back up
    assert "bf16" in str(jax.make_jaxpr(forward)(params, x))  # the matmuls really run in bf16
    losses = []
    for _ in range(60):
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(float(loss))
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("compute, scale_dtype", [("bfloat16", jnp.float32), ("float16", jnp.float16)])
def test_jmp_version_runs_unchanged_on_mixprec_jax(compute, scale_dtype):
    """The seed's jmp program with ``import mixprec.jax as jmp``; the float16 variant with a float16 loss
    scale is jmp#47's crash (``lax.select`` float32 vs float16 in ``adjust``)."""
    import mixprec.jax as jmp

    policy = jmp.get_policy(f"params=float32,compute={compute},output=float32")

    def forward(params, x):
        params, x = policy.cast_to_compute((params, x))
        h = jax.nn.relu(x @ params["w1"])
        return policy.cast_to_output(h @ params["w2"])

    def loss_fn(params, x, y):
        return jnp.mean((forward(params, x) - y) ** 2)

    loss_scale = jmp.DynamicLossScale(scale_dtype(2 ** 15))
    opt = optax.adamw(3e-4 * 30)

    def train_step(params, opt_state, loss_scale, x, y):
        def scaled_loss(p):
            return loss_scale.scale(loss_fn(p, x, y))
        grads = jax.grad(scaled_loss)(params)
        grads = loss_scale.unscale(grads)

        finite = jmp.all_finite(grads)              # the inf/NaN check
        loss_scale = loss_scale.adjust(finite)      # halve or grow the scale
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # Commit the step only if grads were finite, else keep the old trees.
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale

    params = {"w1": jnp.asarray(W1 * 0.02), "w2": jnp.asarray(W2 * 0.02)}
    opt_state = opt.init(params)
    x, y = _data()
    loss = jax.jit(loss_fn)
    first = float(loss(params, x, y))
    step = jax.jit(train_step)
    for _ in range(60):
        params, opt_state, loss_scale = step(params, opt_state, loss_scale, x, y)
    assert float(loss(params, x, y)) < 0.5 * first
    assert loss_scale.loss_scale.dtype == scale_dtype and float(loss_scale.loss_scale) <= 2.0**15
