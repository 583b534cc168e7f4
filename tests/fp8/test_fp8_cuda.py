"""fp8 on a GPU: real fp8 GEMMs (torch._scaled_mm) where the device has them, compiled without a break.

Run by benchmarks/gpu/run.sh (``pytest -m cuda``); skipped without CUDA, and the fp8-GEMM tests skip
below sm89 (Ada, Hopper and later have fp8 tensor cores).
"""

from __future__ import annotations

import pytest
import torch

from fp8_helpers import LINEAR_DB, batch, fp8_linear, sqnr, tiny_gpt
from mixprec import MixedPrecision
from mixprec.tasks.charlm import lm_loss

pytestmark = pytest.mark.cuda


def _fp8_gemms() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_gemms(), reason="needs fp8 GEMMs (sm89+)")


@needs_fp8
def test_auto_uses_scaled_mm_on_a_gpu_with_fp8_gemms():
    mp = MixedPrecision("fp8", "cuda")
    mp.prepare(tiny_gpt().cuda())
    assert mp.fp8.backend == "scaled_mm" and "torch._scaled_mm" in mp.describe()


@needs_fp8
@pytest.mark.parametrize("spec", [{"scaling": "current"}, {"scaling": "delayed"},
                                  {"scaling": "current", "granularity": "rowwise"}], ids=lambda s: "-".join(s.values()))
def test_scaled_mm_meets_the_gates_and_agrees_with_the_emulation(spec):
    if spec.get("granularity") == "rowwise" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("rowwise _scaled_mm needs sm90")
    smm = fp8_linear(256, 512, backend="scaled_mm", **spec).cuda()
    emu = fp8_linear(256, 512, backend="emulate", **spec).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 63, 256, device="cuda", generator=gen)  # 504 tokens: not a multiple of 16
    g = torch.randn(8, 63, 512, device="cuda", generator=gen) * 1e-3
    outs = []
    for lin in (smm, emu):
        xr = x.clone().requires_grad_()
        y = lin(xr)
        y.backward(g)
        outs.append((y.detach(), xr.grad, lin.weight.grad))
    w = smm.weight.detach().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    yr = torch.nn.functional.linear(xr, w, smm.bias.detach())
    yr.backward(g)
    for got, emulated, ref in zip(outs[0], outs[1], (yr.detach(), xr.grad, w.grad)):
        assert sqnr(ref, got) >= LINEAR_DB
        # the same fp8 products; cuBLAS accumulates in its own order (fast accumulation for the output)
        assert sqnr(emulated, got) > 40


@needs_fp8
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_a_compiled_fp8_model_trains_on_the_gpu_without_a_graph_break(recipe):
    torch._dynamo.reset()
    model = tiny_gpt().cuda()
    mp = MixedPrecision(recipe, "cuda")
    mp.prepare(model)
    fwd = torch.compile(model, fullgraph=True)  # a graph break raises
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3, fused=True)
    losses = []
    for step in range(20):
        x, y = (t.cuda() for t in batch(step % 4))
        with mp.autocast():
            loss = lm_loss(fwd(x), y)
        losses.append(float(mp.step(loss, opt, max_grad_norm=1.0).loss))
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0] - 0.5


def test_emulation_runs_on_any_gpu():
    lin = fp8_linear(64, 32, backend="emulate").cuda()
    y = lin(torch.randn(16, 64, device="cuda"))
    assert torch.isfinite(y).all()
