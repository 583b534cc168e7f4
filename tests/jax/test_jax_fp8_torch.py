"""fp8 in JAX against the torch side's fp8 on the same inputs: the same casts and scales bit for bit,
the GEMMs within fp32 accumulation order, delayed scaling's state bit for bit over steps (skips and
spikes included)."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mixprec.fp8 import casts as T  # noqa: E402
from mixprec.fp8 import delayed as TD  # noqa: E402
from mixprec.jax import fp8 as J  # noqa: E402

FORMATS = [pytest.param(T.E4M3, J.E4M3, id="e4m3"), pytest.param(T.E5M2, J.E5M2, id="e5m2")]
U = 2.0**-24  # f32's unit roundoff
DIMS = (((1,), (0,)), ((), ()))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.itemsize == 1 else np.uint32)


def _values(tdt):
    """Every finite fp8 value, the midpoints between neighbours and their f32 neighbours, and random
    values across the exponent range, times scales: what a cast can meet."""
    v = torch.arange(256, dtype=torch.uint8).view(tdt).float()
    v = v[torch.isfinite(v)].unique().sort().values
    mids = ((v[1:].double() + v[:-1].double()) / 2).float()
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(20000, generator=g) * 10 ** (torch.rand(20000, generator=g) * 14 - 8)
    x = torch.cat([v, mids, torch.nextafter(mids, torch.tensor(-1e30)), torch.nextafter(mids, torch.tensor(1e30)), rnd,
                   torch.tensor([1e30, -1e30, float("inf"), float("-inf"), float("nan"), 0.0, -0.0])])
    return x


@pytest.mark.parametrize("tf, jf", FORMATS)
@pytest.mark.parametrize("s", [1.0, 0.37, 2.0**-7, 1234.5])
def test_quantize_is_bitwise_torch_sides(tf, jf, s):
    x = _values(tf.dtype)
    st = torch.tensor(s, dtype=torch.float32)
    want = T.quantize(x, st, tf)
    got = jax.jit(lambda a, sc: J.quantize(a, sc, jf))(x.numpy(), np.float32(s))
    assert got.dtype == jf
    nan = torch.isnan(want.float()).numpy()
    assert nan.sum() == 1 and np.isnan(np.asarray(got, np.float32)[nan]).all()  # NaN stays NaN (its encoding may differ)
    np.testing.assert_array_equal(_bits(got)[~nan], want.view(torch.uint8).numpy()[~nan])


@pytest.mark.parametrize("tf, jf", FORMATS)
def test_scales_are_bitwise_torch_sides(tf, jf):
    rng = np.random.default_rng(0)
    a = np.abs(rng.standard_normal(50000) * 10.0 ** rng.uniform(-20, 30, 50000)).astype(np.float32)
    eps = np.float32(1e-12)
    edge = [0, 1e-12, eps, np.nextafter(eps, np.float32(1)), np.nextafter(eps, np.float32(0)), np.inf, np.nan, 448, 1,
            np.finfo(np.float32).tiny, np.finfo(np.float32).max]
    a = np.concatenate([a, np.asarray(edge, np.float32)])
    prev = np.full_like(a, 3.0)
    want = T.current_scale(torch.from_numpy(a), tf).numpy()
    got = jax.jit(lambda x: J.current_scale(x, jf))(a)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    for margin in (0, 3):
        want = T.delayed_scale(torch.from_numpy(a), torch.from_numpy(prev), tf, margin).numpy()
        got = jax.jit(lambda x, p: J.delayed_scale(x, p, jf, margin))(a, prev)
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _torch_fp8_linear(scaling, fmt="hybrid", history=4, algo="max", margin=0, seed=0, n_in=64, n_out=32):
    from torch import nn

    from mixprec.fp8.linear import Fp8Config as TorchFp8Config
    from mixprec.fp8.swap import convert_
    from mixprec.recipes import Fp8Spec

    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=False)
    delayed = {"amax_history_len": history, "amax_compute_algo": algo, "margin": margin} if scaling == "delayed" else {}
    spec = Fp8Spec(scaling, format=fmt, **delayed)  # (the delayed-only options are refused under other scalings)
    return convert_(lin, TorchFp8Config.from_spec(spec, "emulate"), "lin", history)


def _bound(a_q, sa, b_q, sb, k):
    """fp32 accumulation-order bound of one side against the other: (2K + 8) u sum_k |a_k b_k|, from the
    dequantized fp8 operands (both sides multiply the same fp8 values)."""
    a = np.abs(a_q.double().numpy() / float(sa))
    b = np.abs(b_q.double().numpy() / float(sb))
    return (2 * k + 8) * U * (a @ b)


def _check_step(lin, tf, x, g, got_out, got_gx, got_gw, scales):
    """The torch layer's output and gradients on (x, g) against JAX's, within the accumulation bound."""
    fx, fw, fg = tf
    xt = torch.from_numpy(x).requires_grad_(True)
    out = lin(xt)
    out.backward(torch.from_numpy(g))
    sx, sw, sg = scales
    w = lin.weight.detach()
    x_q, w_q, g_q = T.quantize(xt.detach(), sx, fx), T.quantize(w, sw, fw), T.quantize(torch.from_numpy(g), sg, fg)
    checks = [(out.detach(), got_out, _bound(x_q, sx, w_q.t(), sw, x.shape[1])),
              (xt.grad, got_gx, _bound(g_q, sg, w_q, sw, g.shape[1])),
              (w.grad if w.grad is not None else lin.weight.grad, np.asarray(got_gw).T, _bound(g_q.t(), sg, x_q, sx, x.shape[0]))]
    for want, got, bound in checks:
        err = np.abs(want.double().numpy() - np.asarray(got, np.float64))
        assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    return out


@pytest.mark.parametrize("scaling", ["current", "none"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_a_linear_is_the_torch_sides_within_accumulation_order(scaling, fmt):
    lin = _torch_fp8_linear(scaling, fmt)
    rng = np.random.default_rng(1)
    x = (3 * rng.standard_normal((24, 64))).astype(np.float32)
    g = (1e-3 * rng.standard_normal((24, 32))).astype(np.float32)
    cfg = J.Fp8Config(J.casts.role_formats(fmt), scaling)
    w = lin.weight.detach().numpy().T.copy()
    out, vjp = jax.vjp(lambda a, b: J.fp8_dot_general(a, b, DIMS, cfg), x, w)
    gx, gw = vjp(g)
    tf = T.role_formats(fmt)
    one = torch.tensor(1.0)
    if scaling == "current":
        scales = [T.current_scale(T.amax(t), f) for t, f in zip((torch.from_numpy(x), lin.weight.detach(), torch.from_numpy(g)), tf)]
    else:
        scales = [one, one, one]
    _check_step(lin, tf, x, g, out, gx, gw, scales)
    assert out.dtype == jnp.float32 and gx.dtype == jnp.float32 and gw.dtype == jnp.float32


@pytest.mark.parametrize("algo, margin", [("max", 0), ("most_recent", 2)])
def test_delayed_scaling_state_is_the_torch_sides_bit_for_bit_over_steps(algo, margin):
    """Six steps of one layer, with an input spike at step 2 and a skipped step at 3: after each step the
    amax history and the scales are bitwise the torch layer's, the outputs and gradients within
    accumulation order."""
    history = 4
    lin = _torch_fp8_linear("delayed", history=history, algo=algo, margin=margin)
    cfg = J.Fp8Config(scaling="delayed", amax_history_len=history, amax_compute_algo=algo, margin=margin)
    meta = J.Fp8Meta.init(cfg)
    w = lin.weight.detach().numpy().T.copy()
    tf = T.role_formats("hybrid")
    step = jax.jit(lambda a, b, m, gg: jax.vjp(lambda a, b, m: J.fp8_dot_general(a, b, DIMS, cfg, m), a, b, m)[1](gg))
    fwd = jax.jit(lambda a, b, m: J.fp8_dot_general(a, b, DIMS, cfg, m))
    for t in range(6):
        rng = np.random.default_rng(10 + t)
        x = ((100.0 if t == 2 else 1.0) * rng.standard_normal((24, 64))).astype(np.float32)
        g = (1e-3 * rng.standard_normal((24, 32))).astype(np.float32)
        scales = [lin.fp8_scale[i].clone() for i in range(3)]
        np.testing.assert_array_equal(_bits(meta.scale), _bits(lin.fp8_scale.numpy()))
        gx, gw, observed = step(x, w, meta, g)
        _check_step(lin, tf, x, g, fwd(x, w, meta), gx, gw, scales)
        lin.weight.grad = None
        skipped = t == 3
        TD.update([lin.fp8_amax_history], [lin.fp8_scale], list(tf), algo, margin, torch.tensor(skipped))
        meta = J.update(meta, observed, skipped=skipped)
        np.testing.assert_array_equal(_bits(meta.amax_history), _bits(lin.fp8_amax_history.numpy()))
        np.testing.assert_array_equal(_bits(meta.scale), _bits(lin.fp8_scale.numpy()))
    assert float(lin.fp8_scale[0]) != 1.0  # the scales moved


def test_the_margin_bound_and_the_delayed_only_fields_are_the_torch_sides():
    # found by qa: mixprec.jax accepted margins 15..~140 and delayed-only fields under current scaling
    from mixprec.fp8.options import max_margin
    from mixprec.recipes import Fp8Spec

    assert J.casts.max_margin() == max_margin() == 14
    for kwargs in ({"margin": 15}, {"scaling": "current", "margin": 1}, {"scaling": "current", "amax_history_len": 4}):
        for make in (J.Fp8Config, Fp8Spec):  # refused alike on both sides
            with pytest.raises(ValueError):
                make(**{"scaling": "delayed", **kwargs})
    J.Fp8Config(scaling="delayed", margin=14)
    Fp8Spec(scaling="delayed", margin=14)
