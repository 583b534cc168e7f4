"""MXFP8 block scaling: the GEMMs within fp8's gates, the rounding of the scales, the recipe, and the GPU
path refused where the hardware lacks it (the parity with torchao's MX emulation, bit for bit, is in
test_fp8_torchao.py, with the test-only extra)."""

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
