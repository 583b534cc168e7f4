"""fp8-current against the incumbent: torchao's ``Float8Linear(emulate=True)``, bit for bit.

torchao is a test-only extra (``pip install -e ".[test-fp8]"``, pinned to a release that resolves
against torch 2.13 without replacing it); these tests skip without it. Same weights, same inputs:

- tensorwise current scaling, fp32 inputs: the layer output, the input gradient and the weight
  gradient are bitwise torchao's (the scale in float64 then fp32, saturating casts, e4m3 for input
  and weight, e5m2 for the output gradient, dequantize-then-matmul in fp32 with the same layouts).

Where mixprec differs on purpose (each shown below):

- the weight gradient of a bf16 input stays fp32 (torchao rounds it to the input's dtype, bf16,
  before autograd widens it back to the fp32 parameter's): mixprec's is torchao's before that rounding;
- delayed scaling (torchao removed it; mixprec follows Transformer Engine) and e5m2 gradients under
  rowwise scaling (torchao's rowwise recipe uses e4m3 and power-of-two scales: ``fp8={"granularity":
  "rowwise", "format": "e4m3", "pow2_scales": True}`` is that recipe) are not compared here.
"""

from __future__ import annotations

import copy

import pytest
import torch

float8 = pytest.importorskip("torchao.float8", reason="torchao is a test-only extra: pip install -e '.[test-fp8]'")

from fp8_helpers import fp8_linear  # noqa: E402
from mixprec.fp8 import mx  # noqa: E402
from mixprec.fp8.casts import E4M3, E5M2  # noqa: E402


def _pair(in_f: int, out_f: int, seed: int, bias: bool = True):
    ours = fp8_linear(in_f, out_f, seed=seed, bias=bias)
    plain = torch.nn.Linear(in_f, out_f, bias=bias)
    plain.load_state_dict({k: v for k, v in ours.state_dict().items()})
    theirs = float8.float8_linear.Float8Linear.from_float(copy.deepcopy(plain),
                                                          config=float8.Float8LinearConfig(emulate=True))
    return ours, theirs


def _fwd_bwd(layer, x, g):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("shape", [(64, 128, 32), (2, 24, 64, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bias", [True, False])
def test_current_tensorwise_is_bitwise_torchao(shape, seed, bias):
    *lead, in_f, out_f = shape
    ours, theirs = _pair(in_f, out_f, seed, bias)
    gen = torch.Generator().manual_seed(10 + seed)
    scale = 10.0 ** (seed - 1)  # small, unit and large activations
    x = torch.randn(*lead, in_f, generator=gen) * scale
    g = torch.randn(*lead, out_f, generator=gen) * 1e-4
    a, b = _fwd_bwd(ours, x, g), _fwd_bwd(theirs, x, g)
    for name, mine, ref in zip(("output", "grad_input", "grad_weight", "grad_bias"), a, b):
        if ref is None:
            assert mine is None
            continue
        assert mine.dtype == ref.dtype and torch.equal(mine, ref), name


def test_with_bf16_inputs_only_the_weight_gradients_rounding_differs():
    ours, theirs = _pair(64, 32, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    g = torch.randn(48, 32, generator=gen) * 1e-3
    a, b = _fwd_bwd(ours, x, g), _fwd_bwd(theirs, x, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # output and input gradient (bf16)
    assert a[2].dtype == b[2].dtype == torch.float32
    assert not torch.equal(a[2], b[2])
    assert torch.equal(a[2].bfloat16().float(), b[2])  # torchao's is ours rounded to bf16


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
def test_the_exported_casts_pass_gradients_as_torchaos_do(fmt_name):
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    from mixprec.fp8 import amax, current_scale, dequantize, quantize
    from mixprec.fp8.casts import E4M3, E5M2

    fmt = E4M3 if fmt_name == "e4m3" else E5M2
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=gen) * 1e-3
    g = torch.randn(16, 32, generator=gen) * 1e-2
    s = current_scale(amax(x), fmt)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = dequantize(quantize(ours, s, fmt), s)
    y_ref = hp_tensor_and_scale_to_float8(theirs, s, fmt.dtype).to_original_precision()
    assert torch.equal(y, y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(ours.grad, theirs.grad) and bool((ours.grad != 0).all())


# ---------------------------------------------------------------- MXFP8 (issue 28.7): torchao's MX emulation

MX_FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def _blocks(seed: int, rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Values over a wide exponent range, block by block (so that every block gets another scale), with
    zero blocks, a NaN block, tiny (subnormal-scale) blocks and blocks whose amax is a power of two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, cols // 32, 1), generator=g)
                                                          .float()).repeat_interleave(32, -1).reshape(rows, cols)
    x[0, :32] = 0.0
    x[1, 32:64] = 1e-40
    x[2, :32] = 2.0**5
    x[3, 64] = float("nan")
    x[4, :32] = torch.linspace(-448.0, 448.0, 32)
    return x


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("mode", mx.MODES)
def test_the_mx_cast_is_bitwise_torchaos(fmt, mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is a test-only extra")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    for seed in range(4):
        x = _blocks(seed)
        q, e, _ = mx.mx_quantize(x, fmt, mode)
        e_ref, q_ref = mx_tensor.to_mx(x, fmt.dtype, 32, ScaleCalculationMode(mode))
        assert torch.equal(e, e_ref.view(torch.uint8)), "block scales"
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "elements (bit for bit, NaN included)"
        deq = mx.mx_dequantize(q, e)
        ref = mx_tensor.to_dtype(q_ref, e_ref, fmt.dtype, 32, torch.float32)
        assert torch.equal(deq.nan_to_num(nan=7.0), ref.nan_to_num(nan=7.0))


def test_swizzle_is_cublas_layout_as_torchao_builds_it():
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils", reason="torchao is a test-only extra")
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((128, 4), (256, 8), (200, 7), (64, 12)):
        e = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8)
        assert torch.equal(mx.swizzle(e), utils.to_blocked(e)), (rows, cols)


def _mx_pair(in_f: int, out_f: int, seed: int):
    mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear", reason="torchao extra")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    ours = fp8_linear(in_f, out_f, seed=seed, granularity="mx", format="e4m3")
    theirs = mxfp8_linear.MXFP8Linear(in_f, out_f, kernel_preference=KernelPreference.EMULATED,
                                      scale_calculation_mode=ScaleCalculationMode.RCEIL)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("shape", [(64, 64, 32), (2, 32, 128, 96)], ids=["2d", "3d"])
@pytest.mark.parametrize("seed", range(2))
def test_the_mx_layer_is_bitwise_torchaos_emulated_mxfp8_linear(shape, seed):
    *lead, in_f, out_f = shape
    ours, theirs = _mx_pair(in_f, out_f, seed)
    g = torch.Generator().manual_seed(20 + seed)
    x = torch.randn(*lead, in_f, generator=g) * 10.0 ** (seed - 1)
    grad = torch.randn(*lead, out_f, generator=g) * 1e-3
    got, ref = [], []
    for layer, out in ((ours, got), (theirs, ref)):
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.backward(grad)
        out += [y.detach(), xr.grad, layer.weight.grad, layer.bias.grad]
    for name, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


