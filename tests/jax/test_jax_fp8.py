"""fp8 in JAX: the recipes carry it (never bf16 under the fp8 name), the dot survives XLA's excess
precision, any contraction works, the Flax layers (NNX and linen) train with their state, and compare
runs fp8 for real or refuses."""

import json

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.jax import fp8  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))


def _sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    noise = np.linalg.norm(ref - got)
    return np.inf if noise == 0 else 20 * np.log10(np.linalg.norm(ref) / noise)


def test_the_fp8_recipes_carry_fp8_and_every_jax_recipe_is_what_the_torch_side_names():
    """No recipe mixprec.jax runs is another recipe under its name: each fp8 recipe carries its fp8
    config (bf16-mixed underneath, as on the torch side), every other one none."""
    from mixprec import recipes as torch_recipes

    for name in mpj.recipe_names():
        if name == "auto":
            continue
        r, t = mpj.get_recipe(name), torch_recipes.get_recipe(name)
        assert (r.fp8 is None) == (t.fp8 is None), name
        if t.fp8 is not None:
            assert r.fp8.scaling == t.fp8.scaling and r.fp8.amax_history_len == t.fp8.amax_history_len
            assert r.fp8_skip_first_last == t.fp8.skip_first_last
            assert str(r.policy) == "p=full,c=bf16,o=full" and r.loss_scaling == "none"
    assert {n for n in mpj.recipe_names() if mpj.get_recipe(n).fp8 is not None} == {
        "fp8-current", "fp8-delayed", "fp8-unscaled"}
    assert [jnp.dtype(f).name for f in mpj.get_recipe("fp8-unscaled").fp8.formats] == ["float8_e4m3fn"] * 3


@pytest.mark.parametrize("spec, fragment", [
    ({"granularity": "rowwise"}, "rowwise scaling is torch-only"),
    ({"pow2_scales": True}, "power-of-two scales are torch-only"),
    ({"gemm": "scaled_mm"}, "names torch._scaled_mm"),
])
def test_torch_only_fp8_options_are_refused(spec, fragment):
    from mixprec.recipes import Fp8Spec

    with pytest.raises(ValueError, match=fragment):
        fp8.Fp8Config.from_spec(Fp8Spec("current", **spec))


def test_the_fp8_dot_survives_xla_excess_precision():
    """The casts round in plain jax.jit (XLA's default flags) exactly as with excess precision off, and
    the result is not the f32 product."""
    from mixprec.jax.comparison import COMPILER_OPTIONS

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((16, 64), (64, 32)))
    f = lambda a, b: fp8.Fp8DotGeneral(fp8.Fp8Config())(a, b, DIMS)  # noqa: E731
    default = np.asarray(jax.jit(f)(x, w))
    strict = np.asarray(jax.jit(f, compiler_options=COMPILER_OPTIONS)(x, w))
    np.testing.assert_array_equal(default, strict)
    assert np.abs(default - x @ w).max() > 1e-2 * np.abs(x @ w).max()
    qdq = jax.jit(lambda a: fp8.dequantize(fp8.quantize(a, jnp.float32(1.0), fp8.E4M3), jnp.float32(1.0)))
    np.testing.assert_array_equal(np.asarray(qdq(x)), x.astype(jnp.float8_e4m3fn).astype(np.float32))


def test_any_contraction_with_batch_dims_meets_torchaos_gates():
    """An attention-shaped contraction ('bqd,bkd->bqk'): output and both gradients >= 20 dB against f32."""
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((2, 16, 32)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((2, 16, 16)).astype(np.float32)
    dims = (((2,), (2,)), ((0,), (0,)))
    dot = fp8.Fp8DotGeneral(fp8.Fp8Config())

    @jax.jit
    def both(q, k, g):
        out, vjp = jax.vjp(lambda a, b: dot(a, b, dims), q, k)
        ref, vjp_ref = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), q, k)
        return (out, *vjp(g)), (ref, *vjp_ref(g))

    got_all, want_all = both(q, k, g)
    assert got_all[0].shape == want_all[0].shape
    for got, want in zip(got_all, want_all):
        assert 20 < _sqnr(want, got) < 60  # fp8 (~30 dB), not f32


def test_output_and_gradient_dtypes_follow_the_operands():
    x = jax.ShapeDtypeStruct((4, 16), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    dot = fp8.Fp8DotGeneral(fp8.Fp8Config())

    def dtypes(a, b):
        out, vjp = jax.vjp(lambda a, b: dot(a, b, DIMS), a, b)
        return (out, *vjp(jnp.ones_like(out)))

    out, gx, gw = jax.eval_shape(dtypes, x, w)  # traced, not run
    assert (out.dtype, gx.dtype, gw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
    w16 = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)
    assert jax.eval_shape(lambda a, b: dot(a, b, DIMS, preferred_element_type=jnp.float32), x, w16).dtype == jnp.float32


@pytest.mark.parametrize("call, fragment", [
    (lambda: fp8.Fp8DotGeneral(fp8.Fp8Config(scaling="delayed")), "delayed scaling keeps an amax history"),
    (lambda: fp8.fp8_dot_general(jnp.ones((2, 16)), jnp.ones((16, 16)), DIMS, fp8.Fp8Config(scaling="delayed")),
     "pass the layer's state"),
    (lambda: fp8.fp8_dot_general(jnp.ones((2, 16)), jnp.ones((16, 16)), DIMS, fp8.Fp8Config(),
                                 fp8.Fp8Meta.init(fp8.Fp8Config(scaling="delayed"))), "keeps no state"),
    (lambda: fp8.Fp8DotGeneral(fp8.Fp8Config())(jnp.ones((2, 16)), jnp.ones((16, 16)), DIMS, out_sharding="x"),
     "does not implement"),
    (lambda: fp8.Fp8Config(margin=200), "underflows f32 to 0"),
    # found by qa: accepted here and refused by the torch side (margin 15..~140: every cast below e4m3's normals;
    # delayed-only fields under current scaling: ignored)
    (lambda: fp8.Fp8Config(scaling="delayed", margin=15), r"margin=15: .* past margin 14 is below e4m3's smallest normal"),
    (lambda: fp8.Fp8Config(scaling="current", margin=1), "fp8 margin applies to delayed scaling only; with "
                                                          "scaling='current' it would be ignored"),
    (lambda: fp8.Fp8Config(scaling="none", amax_history_len=16, amax_compute_algo="most_recent"),
     "fp8 amax_history_len, amax_compute_algo apply to delayed scaling only"),
    (lambda: fp8.Fp8Config(formats=("e4m3", "e4m3", "int8")), "fp8 formats must be three of float8_e4m3fn / float8_e5m2"),
    (lambda: fp8.Fp8Config(amax_history_len=0), "amax_history_len must be an integer >= 1"),
    (lambda: mpj.get_recipe("fp8-delayed").matmul(jnp.ones((2, 16)), jnp.ones((16, 16))), "scales from an amax history"),
    (lambda: fp8.config_for("bf16-mixed"), "not an fp8 recipe"),
])
def test_fp8_misuse_is_refused(call, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        call()


def test_recipe_matmul_is_fp8_under_fp8_and_plain_otherwise():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    np.testing.assert_array_equal(mpj.get_recipe("bf16-mixed").matmul(x, w), jnp.asarray(x) @ jnp.asarray(w))
    got = mpj.get_recipe("fp8-current").matmul(x, w)
    np.testing.assert_array_equal(got, fp8.fp8_dot_general(x, w, DIMS, fp8.config_for("fp8-current")))
    assert not np.array_equal(np.asarray(got), x @ w)


# ---------------------------------------------------------------------------- delayed scaling's update


def test_update_follows_the_optimizer_state_and_skips():
    cfg = fp8.Fp8Config(scaling="delayed", amax_history_len=3)
    meta = {"l": fp8.Fp8Meta.init(cfg)}
    observed = {"l": fp8.Fp8Meta(jnp.zeros((3, 3)).at[0].set(jnp.array([2.0, 4.0, 8.0])), jnp.zeros(3), cfg)}
    tx = mpj.skip_nonfinite(optax.sgd(0.1))
    params = {"w": jnp.ones(2)}

    @jax.jit
    def after(grads):
        _, state = tx.update(grads, tx.init(params), params)
        return fp8.update(meta, observed, state)["l"]

    stepped = after({"w": jnp.ones(2)})
    np.testing.assert_array_equal(stepped.amax_history, [[0, 0, 0], [0, 0, 0], [2, 4, 8]])
    np.testing.assert_array_equal(stepped.scale, [448 / 2, 448 / 4, 57344 / 8])
    skipped = after({"w": jnp.array([1.0, jnp.nan])})
    np.testing.assert_array_equal(skipped.amax_history, np.zeros((3, 3)))
    np.testing.assert_array_equal(skipped.scale, np.ones(3))
    with pytest.raises(ValueError, match="not both"):
        fp8.update(meta, observed, tx.init(params), skipped=True)


# ---------------------------------------------------------------------------- Flax


@pytest.mark.slow
def test_nnx_linear_trains_in_fp8_with_delayed_state_and_eval_leaves_it():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
            self.a = nnx.Linear(16, 32, dot_general=fp8.NnxFp8DotGeneral("fp8-delayed"), **kw)
            self.b = nnx.Linear(32, 16, dot_general=fp8.Fp8DotGeneral(fp8.config_for("fp8-current")), **kw)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    model = Model(nnx.Rngs(0))
    tx = mpj.skip_nonfinite(optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.Fp8MetaVariable))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    y = jnp.asarray(np.tanh(rng.standard_normal((32, 16))), jnp.float32)

    def loss_fn(m):
        return jnp.mean((m(x).astype(jnp.float32) - y) ** 2)

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(m)
        opt.update(m, grads)
        fp8.update_nnx(m, grads, opt.opt_state)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    meta = model.a.dot_general.meta.get_value()
    assert meta.amax_history[0].tolist() == [0, 0, 0] and (meta.amax_history[-1] > 0).all()
    assert (meta.scale != 1).all()
    before = jax.tree_util.tree_map(np.asarray, meta)
    model(x)  # an eval forward: no gradient, no history
    after = model.a.dot_general.meta.get_value()
    np.testing.assert_array_equal(after.amax_history, before.amax_history)
    grads = nnx.grad(loss_fn)(model)  # without the fp8 state
    with pytest.raises(ValueError, match="holds no Fp8MetaVariable"):
        fp8.update_nnx(model, grads, optimizer.opt_state)


def test_linen_dense_takes_the_fp8_dot_as_dot_general_cls_with_a_collection():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(32, dtype=jnp.bfloat16, dot_general_cls=fp8.linen_dot_general_cls("fp8-delayed"))(x)
            return nn.Dense(16, dot_general=fp8.Fp8DotGeneral(fp8.config_for("fp8-current")))(jax.nn.relu(h))

    x = jnp.ones((8, 16))
    variables = Model().init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params", fp8.COLLECTION}
    params, meta = variables["params"], variables[fp8.COLLECTION]

    def loss(p, m):
        return jnp.mean(Model().apply({"params": p, fp8.COLLECTION: m}, x).astype(jnp.float32) ** 2)

    gp, gm = jax.grad(loss, argnums=(0, 1))(params, meta)
    new = fp8.update(meta, gm, skipped=False)
    (m,) = [v for v in jax.tree_util.tree_leaves(new, is_leaf=lambda v: isinstance(v, fp8.Fp8Meta))]
    assert (m.amax_history[-1] > 0).all() and (m.scale != 1).all()
    assert jax.tree_util.tree_structure(gp) == jax.tree_util.tree_structure(params)


def test_flax_fp8_ops_agree_where_they_apply():
    """flax's Fp8DirectDotGeneralOp (delayed scaling) against ours on the same operands. Its first step
    casts with scale 1 (an empty history): our unscaled hybrid dot, the same fp8 values, so output and
    gradients agree to fp32 accumulation order. Later, flax divides by the reciprocal of our scale:
    the scales agree to 2 ulp, the casts but for values that land within an ulp of an fp8 midpoint."""
    pytest.importorskip("flax")
    from flax.linen import fp8_ops

    rng = np.random.default_rng(4)
    x = (3 * rng.standard_normal((16, 32))).astype(np.float32)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    g = (1e-2 * rng.standard_normal((16, 16))).astype(np.float32)
    one, hist = jnp.ones((1,), jnp.float32), jnp.zeros((16,), jnp.float32)

    def flax_dot(a, b):
        return fp8_ops.fp8_scaled_dot_general(a, b, DIMS, preferred_element_type=jnp.float32, lhs_scale=one,
                                              rhs_scale=one, grad_scale=one, lhs_amax_history=hist,
                                              rhs_amax_history=hist, grad_amax_history=hist)

    ours = fp8.Fp8DotGeneral(fp8.Fp8Config(scaling="none"))
    got = [jax.vjp(f, x, w) for f in (flax_dot, lambda a, b: ours(a, b, DIMS))]
    (out_f, vjp_f), (out_o, vjp_o) = got
    xq, wq = (np.abs(a.astype(jnp.float8_e4m3fn).astype(np.float64)) for a in (x, w))
    bound = (2 * 32 + 8) * 2.0**-24 * (xq @ wq)
    assert (np.abs(np.asarray(out_f, np.float64) - np.asarray(out_o)) <= bound).all()
    for a, b in zip(vjp_f(g), vjp_o(g)):
        assert _sqnr(b, a) > 60  # the same fp8 gradient values, accumulated in another order
    # later steps: flax's scale is the reciprocal of ours
    amax = jnp.float32(np.abs(x).max())
    flax_scale = fp8_ops.compute_scale(amax, jnp.float32(1.0), jnp.float32(448.0))
    ours_scale = fp8.delayed_scale(amax, jnp.float32(1.0), fp8.E4M3)
    assert abs(float(1 / flax_scale) / float(ours_scale) - 1) <= 2 * 2.0**-23
    qf = np.asarray(fp8_ops.quantize(jnp.asarray(x), jnp.float8_e4m3fn, flax_scale, jnp.float32), np.float32)
    qo = np.asarray(fp8.quantize(jnp.asarray(x), ours_scale, fp8.E4M3), np.float32)
    differ = qf != qo
    assert differ.mean() < 0.01
    assert (np.abs(qf - qo)[differ] <= 2.0 ** (np.floor(np.log2(np.abs(qo[differ]))) - 3)).all()  # one e4m3 ulp


# ---------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def fp8_compare():
    return mpj.compare("jax_tasks:make_task", ("bf16-mixed", "fp8-current", "fp8-delayed"), steps=30,
                       task_kwargs={"kind": "mlp"})


@pytest.mark.slow
def test_compare_runs_fp8_for_real(fp8_compare):
    r = fp8_compare
    assert {k: v.status for k, v in r.verdicts.items()} == {"bf16-mixed": "TRACKS", "fp8-current": "TRACKS",
                                                             "fp8-delayed": "TRACKS"}
    bf16 = r.run_for("bf16-mixed").loss
    for name in ("fp8-current", "fp8-delayed"):
        assert not np.array_equal(r.run_for(name).loss, bf16)  # computed otherwise: not bf16 under the fp8 name
        layers = json.loads(r.to_json())["fp8_layers"][name]
        assert [v.split(":")[0] for v in layers.values()] == ["bf16", "fp8", "bf16"]
    assert not np.array_equal(r.run_for("fp8-current").loss, r.run_for("fp8-delayed").loss)


def test_compare_refuses_fp8_on_a_task_that_would_run_bf16():
    from mixprec.tasks import TaskError

    with pytest.raises(TaskError, match="computes no dot through recipe.dot_general"):
        mpj.compare("jax_tasks:make_task", ("fp8-current",), steps=5)
