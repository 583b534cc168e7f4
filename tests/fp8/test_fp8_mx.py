"""MXFP8 block scaling: the casts bitwise torchao's MX emulation, the layer bitwise torchao's emulated
MXFP8Linear (output and all gradients), the GEMMs within fp8's gates, and the GPU path refused where
the hardware lacks it. torchao is a test-only extra: the parity tests skip without it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fp8_helpers import LINEAR_DB, fp8_linear, sqnr
from mixprec import MixedPrecision
from mixprec.fp8 import mx
from mixprec.fp8.casts import E4M3, E5M2

FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


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


@pytest.mark.parametrize("fmt", FORMATS)
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


def test_rceil_is_the_hardwares_exact_rounding_where_torchaos_eager_log2_rounds_down():
    # a block whose amax / 448 sits one ulp above a power of two: ceil(log2(.)) in fp32 gives that power
    # (torchao's eager code), so the block's largest value lands past 448 and saturates; the exact
    # rounding (cvt.rp, the hardware's) takes the next power and nothing saturates
    amax = torch.tensor(448.0 * 2.0**-8 * (1 + 2.0**-23))
    e, mult = mx.block_scales((amax / 1).reshape(1), E4M3, "rceil")
    ratio = float(amax) / 448.0
    assert int(e) - 127 == math.ceil(math.log2(ratio)) == -7  # exact: 2**-8 < ratio
    assert float(torch.ceil(torch.log2(torch.tensor(ratio, dtype=torch.float32)))) == -8.0  # fp32 log2: rounds to -8
    x = torch.full((32,), float(amax))
    q, _, _ = mx.mx_quantize(x.reshape(1, 32), E4M3)
    assert float(q.float().max()) < 448.0  # within range, unsaturated


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


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_the_mx_layer_meets_the_gates_against_fp32_with_any_number_of_tokens(fmt):
    lin = fp8_linear(128, 64, granularity="mx", format=fmt)
    x = torch.randn(3, 37, 128) * 3  # 111 tokens: the weight gradient pads them to 128 (zeros change no block)
    g = torch.randn(3, 37, 64) * 1e-3
    w = lin.weight.detach().clone().requires_grad_()
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = F.linear(xf, w, lin.bias.detach())
    y_ref.backward(g)
    y = lin(xr)
    y.backward(g)
    for name, ref, got in (("output", y_ref, y), ("grad_input", xf.grad, xr.grad), ("grad_weight", w.grad, lin.weight.grad)):
        assert sqnr(ref, got) >= LINEAR_DB, f"{name}: {sqnr(ref, got):.1f} dB"


def test_an_mx_recipe_trains_and_says_what_it_is():
    from fp8_helpers import tiny_gpt, train

    model = tiny_gpt()
    mp = MixedPrecision("fp8", "cpu", fp8={"granularity": "mx", "format": "e4m3"})
    mp.prepare(model)
    text = mp.describe()
    assert "MXFP8 block scaling (a power-of-two e8m0 scale per 32 elements" in text and "7 of 9 nn.Linear in fp8" in text
    assert "fp8=current mx e4m3/e4m3/e4m3" in repr(model.blocks[0].fc)
    model.blocks[0].odd = torch.nn.Linear(32, 48)  # 48: a multiple of 16, not of 32
    assert "32x48: MXFP8 GEMMs need both dims multiples of 32" in str(mx_decisions(model))
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
    losses = train(model, mp, opt, range(3))
    assert all(math.isfinite(v) for v in losses)


def mx_decisions(model):
    from mixprec.fp8 import decide
    from mixprec.recipes import Fp8Spec

    return [d.reason for d in decide(model, Fp8Spec(granularity="mx", format="e4m3"))]


def test_mx_options_and_the_gpu_path_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="granularity='mx' .* needs scaling='current'"):
        MixedPrecision("fp8-delayed", "cpu", fp8={"granularity": "mx"})
    with pytest.raises(ValueError, match="no pow2_scales"):
        MixedPrecision("fp8", "cpu", fp8={"granularity": "mx", "pow2_scales": True})
    mp = MixedPrecision("fp8", "cpu", fp8={"granularity": "mx", "gemm": "scaled_mm"})
    from fp8_helpers import tiny_gpt

    with pytest.raises(RuntimeError, match=r"needs block-scaled fp8 GEMMs \(CUDA sm100\+: Blackwell\); the cpu device "
                                           r"has none. Use gemm='emulate'"):
        mp.prepare(tiny_gpt())
    auto = MixedPrecision("fp8", "cpu", fp8={"granularity": "mx"})
    auto.prepare(tiny_gpt())
    assert auto.fp8.backend == "emulate"  # auto: the emulation where the hardware has no MX GEMMs
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        mx.mx_quantize(torch.randn(4, 48), E4M3)


@pytest.mark.cuda
def test_the_mx_gemm_on_blackwell_agrees_with_the_emulation():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)):
        pytest.skip("needs CUDA sm100+ (Blackwell) for block-scaled fp8 GEMMs")
    a, b = torch.randn(256, 512, device="cuda"), torch.randn(128, 512, device="cuda")
    emu = mx.mx_mm(a, E4M3, b, E4M3, "emulate", "rceil")
    hw = mx.mx_mm(a, E4M3, b, E4M3, "scaled_mm", "rceil")
    assert sqnr(emu, hw) > 60  # the same operands, another accumulation order
