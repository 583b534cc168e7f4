"""probe_grad_underflow on a gradient pytree: the torch probe's exact counts, checked against real casts."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402  (installed with jax)

import mixprec.jax as mpj  # noqa: E402


@pytest.fixture(scope="module")
def grads():
    rng = np.random.default_rng(3)
    # magnitudes spread over 2^-40 .. 2^8, signs mixed, a few exact zeros: every category is populated
    def spread(n):
        return (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-40, 8, n)).astype(np.float32)
    w = spread(3000)
    w[:7] = 0.0
    return {"encoder": {"kernel": jnp.asarray(w.reshape(60, 50)), "bias": jnp.asarray(spread(50))},
            "head": [jnp.asarray(spread(400))], "step": jnp.int32(3)}


def _cast_counts(values, dtype, scale):
    a = np.abs(values[values != 0].astype(np.float64)) * scale
    with np.errstate(over="ignore"):  # overflowing to inf is what is being counted
        cast = a.astype(np.float32).astype(dtype).astype(np.float64)  # a * 2^k is exact in f32 here; one rounding
    info = ml_dtypes.finfo(dtype)
    zero = np.mean(cast == 0)
    overflow = np.mean(~np.isfinite(cast))
    sub = np.mean((cast > 0) & (cast < float(info.smallest_normal)))
    return zero, sub, overflow


@pytest.mark.parametrize("fmt, dtype", [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
@pytest.mark.parametrize("scale", [1.0, 2.0**8, 2.0**16])
def test_counts_equal_real_casts(grads, fmt, dtype, scale):
    report = mpj.probe_grad_underflow(grads)
    values = np.asarray(grads["encoder"]["kernel"]).ravel()
    land = report.landing("encoder.kernel", fmt, scale)
    zero, sub, over = _cast_counts(values, dtype, scale)
    assert (land.zero, land.subnormal, land.overflow) == pytest.approx((zero, sub, over), abs=0)
    if fmt == "f16" and scale == 1.0:
        assert land.zero > 0.1 and land.subnormal > 0  # not vacuous: fp16 loses a good part of these unscaled


def test_names_modules_and_recommended_scale(grads):
    report = mpj.probe_grad_underflow(grads)
    assert [s.name for s in report.params] == ["encoder.bias", "encoder.kernel", "head.0"]  # ints are not gradients
    assert [m.name for m in report.by_module()] == ["encoder", "head"]
    absmax = max(float(jnp.abs(g).max()) for g in (grads["encoder"]["kernel"], grads["encoder"]["bias"], grads["head"][0]))
    rec = report.recommended_scale
    assert rec * absmax < 65504 / 2 <= 2 * rec * absmax  # the largest 2^k with one bit of headroom
    assert report.overall.total == 3450 and report.activations == []


def test_bf16_gradients_are_widened_exactly():
    g = jnp.asarray([2.0**-30, 1.0, 3.0], jnp.bfloat16)
    land = mpj.probe_grad_underflow({"g": g}).landing("g", "f16", 1.0)
    assert land.zero == pytest.approx(1 / 3)


def test_a_tree_without_floats_is_an_error():
    with pytest.raises(ValueError, match="no floating-point leaves"):
        mpj.probe_grad_underflow({"step": jnp.int32(1)})


def test_nnx_gradients_are_named_by_their_parameters_and_grouped_by_module():
    nnx = pytest.importorskip("flax.nnx")
    import jax
    import jax.numpy as jnp

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(2, 3, rngs=rngs)

    model = Model(nnx.Rngs(0))
    grads = nnx.grad(lambda m: m.dense(jnp.ones((1, 2))).sum())(model)
    report = mpj.probe_grad_underflow(grads)
    assert sorted(s.name for s in report.params) == ["dense.bias", "dense.kernel"]
    assert [m.name for m in report.by_module()] == ["dense"]
    assert jax.tree_util.tree_leaves(grads)  # (the State really holds the gradients)
