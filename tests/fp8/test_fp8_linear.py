"""The fp8 linear: its output and both gradients against fp32 (SQNR gates), both GEMM backends, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8_helpers import LINEAR_DB, fp8_linear, sqnr
from mixprec.fp8 import gemm
from mixprec.fp8.casts import E4M3, E5M2, amax, current_scale, quantize

U32 = 2.0**-24  # fp32 unit roundoff

SPECS = [
    pytest.param({"scaling": "current"}, id="current"),
    pytest.param({"scaling": "current", "granularity": "rowwise"}, id="rowwise"),
    pytest.param({"scaling": "current", "granularity": "rowwise", "format": "e4m3", "pow2_scales": True},
                 id="rowwise-torchao-recipe"),
    pytest.param({"scaling": "delayed"}, id="delayed"),
]


def _reference(lin, x, g):
    """The same layer in fp32: output, input gradient, weight gradient, bias gradient."""
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y = F.linear(xr, w, b)
    y.backward(g)
    return y.detach(), xr.grad, w.grad, b.grad


def _run(lin, x, g):
    xr = x.detach().clone().requires_grad_()
    y = lin(xr)
    y.backward(g)
    return y.detach(), xr.grad, lin.weight.grad, lin.bias.grad


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", range(2))
def test_output_and_both_gradients_keep_20_db_against_fp32(spec, seed):
    lin = fp8_linear(128, 64, seed=seed, **spec)
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(4, 32, 128, generator=gen)
    g = torch.randn(4, 32, 64, generator=gen) * 1e-3  # small gradients: what the scale is for
    if spec["scaling"] == "delayed":  # one step first, so the scales come from a history
        _run(lin, x, g)
        from mixprec.fp8.delayed import update

        update([lin.fp8_amax_history], [lin.fp8_scale], lin.fp8_config.formats, "max", 0)
        lin.weight.grad = lin.bias.grad = None
    ref = _reference(lin, x, g)
    got = _run(lin, x, g)
    for name, r, o in zip(("output", "grad_input", "grad_weight"), ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert sqnr(r, o) >= LINEAR_DB, f"{name}: {sqnr(r, o):.1f} dB"
    assert torch.equal(got[3], ref[3])  # the bias is added in high precision: its gradient is exact


def test_unscaled_e4m3_gradients_flush_and_fail_the_gate():
    # the planted bad choice: e4m3 for small gradients with no scaling loses them (the gate sees it)
    lin = fp8_linear(128, 64, scaling="none", format="e4m3")
    x = torch.randn(64, 128)
    g = torch.randn(64, 64) * 1e-4
    ref, got = _reference(lin, x, g), _run(lin, x, g)
    assert sqnr(ref[1], got[1]) < 1.0 and sqnr(ref[2], got[2]) < 1.0


def test_emulation_and_scaled_mm_agree_within_the_fp32_accumulation_bound():
    gen = torch.Generator().manual_seed(0)
    N, K, M = 48, 64, 32
    a, b, g = torch.randn(N, K, generator=gen), torch.randn(M, K, generator=gen), torch.randn(N, M, generator=gen)
    sa, sb, sg = current_scale(amax(a), E4M3), current_scale(amax(b), E4M3), current_scale(amax(g), E5M2)
    aq, bq, gq = quantize(a, sa, E4M3), quantize(b, sb, E4M3), quantize(g, sg, E5M2)
    da, db, dg = aq.float() / sa, bq.float() / sb, gq.float() / sg
    # both compute sum_k a_k b_k from the same fp8 values with fp32 accumulation, in different orders
    # and with the scales applied at different points: |difference| <= (2K + 8) u sum_k |a_k b_k|
    cases = [
        (gemm.output(aq, sa, bq, sb, torch.float32, "emulate"), gemm.output(aq, sa, bq, sb, torch.float32, "scaled_mm"),
         da.abs() @ db.abs().t(), K),
        (gemm.grad_input(gq, sg, bq, sb, torch.float32, "emulate"), gemm.grad_input(gq, sg, bq, sb, torch.float32, "scaled_mm"),
         dg.abs() @ db.abs(), M),
        (gemm.grad_weight(gq, sg, aq, sa, "emulate"), gemm.grad_weight(gq, sg, aq, sa, "scaled_mm"), dg.abs().t() @ da.abs(), N),
    ]
    for emu, smm, mag, k in cases:
        assert emu.dtype == smm.dtype == torch.float32
        assert ((emu - smm).abs() <= (2 * k + 8) * U32 * mag).all()


def test_a_scaled_mm_layer_matches_the_emulated_one():
    emu = fp8_linear(32, 16, backend="emulate")
    smm = fp8_linear(32, 16, backend="scaled_mm")
    x = torch.randn(3, 7, 32)  # 21 tokens: the weight gradient's reduction is zero-padded to 32 for cuBLASLt
    ye, ys = emu(x), smm(x)
    assert sqnr(ye, ys) > 80  # the same fp8 products; only the fp32 summation order differs
    ye.sum().backward()
    ys.sum().backward()
    assert sqnr(emu.weight.grad, smm.weight.grad) > 80


def test_under_autocast_it_computes_from_bf16_and_returns_bf16_with_an_fp32_weight_gradient():
    lin = fp8_linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    assert lin.weight.dtype == torch.float32  # never stored in fp8


def test_frozen_weight_and_no_input_grad_skip_their_gemms():
    lin = fp8_linear(32, 16, bias=False)
    lin.weight.requires_grad_(False)
    x = torch.randn(8, 32, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is None and x.grad is not None
    lin.weight.requires_grad_(True)
    lin(torch.randn(8, 32)).sum().backward()  # the input needs no gradient
    assert lin.weight.grad is not None


def test_repr_names_the_scaling_formats_and_backend():
    assert "fp8=current e4m3/e4m3/e5m2 (emulate)" in repr(fp8_linear(32, 16))
    assert "rowwise" in repr(fp8_linear(32, 16, granularity="rowwise"))
