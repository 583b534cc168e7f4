"""torch.compile of a prepared fp8 model: no graph break in the fp8 linear, and the same numbers as eager."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from fp8_helpers import batch, build, fp8_linear, sqnr
from mixprec.tasks.charlm import lm_loss

SPECS = [{"scaling": "current"}, {"scaling": "delayed"}, {"scaling": "current", "granularity": "rowwise"}]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fwd_bwd(layer, fn, x, g):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(s.values()))
def test_the_fp8_linear_traces_into_one_graph_and_computes_what_eager_does(spec):
    eager = fp8_linear(32, 48, **spec)
    lin = copy.deepcopy(eager)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 48, generator=gen) * 1e-3
    ref, got = _fwd_bwd(eager, eager, x, g), _fwd_bwd(lin, compiled, x, g)
    assert got[0].dtype == torch.bfloat16
    # aot_eager runs the traced ops with eager's kernels: bit for bit (a backward traced under the
    # forward's autocast would have run its GEMMs in bf16 instead: this is what catches it)
    for r, o in zip(ref, got):
        assert torch.equal(r, o)
    if spec["scaling"] == "delayed":  # the amax recordings, forward and backward, are in the graph
        assert torch.equal(eager.fp8_amax_history, lin.fp8_amax_history) and (lin.fp8_amax_history[0] > 0).all()


def _run(model, mp, opt, fwd, steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        with mp.autocast():
            loss = lm_loss(fwd(x), y)
        losses.append(float(mp.step(loss, opt, max_grad_norm=1.0).loss))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_a_compiled_prepared_model_trains_bit_for_bit_as_the_eager_one(recipe):
    opts = {"amax_history_len": 4} if recipe == "fp8-delayed" else {}
    eager, comp = build(recipe, fp8=opts), build(recipe, fp8=opts)
    fwd = torch.compile(comp[0], fullgraph=True, backend="aot_eager")  # the whole model: one graph
    assert _run(*eager, eager[0], range(5)) == _run(*comp, fwd, range(5))
    for (n, p), (_, q) in zip(eager[0].named_parameters(), comp[0].named_parameters()):
        assert torch.equal(p, q), n


def _native_isa() -> str:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip().lower()


# With ATen's CPU kernels forced to another capability (CI's numerics job), inductor's own C++ for this
# model crashes (avx2) or fails to build (default) on an AMX machine; bf16-mixed compiles there. Not fp8's
# doing to chase here: the aot_eager tests above cover the graph, and the CUDA tests cover inductor.
_forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
_forced_isa = bool(_forced) and _forced != _native_isa()  # (the subprocess only when it is set)


@pytest.mark.slow
@pytest.mark.skipif(_forced_isa, reason="inductor breaks under a forced ATEN_CPU_CAPABILITY on this CPU")
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_inductor_compiled_fp8_stays_close_to_eager(recipe):
    eager, comp = build(recipe), build(recipe)
    fwd = torch.compile(comp[0], fullgraph=True)
    grads = []
    for model, f in ((eager[0], eager[0]), (comp[0], fwd)):
        x, y = batch(0)
        with eager[1].autocast():
            lm_loss(f(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for p in model.parameters():
            p.grad = None
    # inductor keeps fused bf16 intermediates in fp32 (no rounding between ops), so an fp8 cast now and
    # then rounds the other way: the gradients differ by about fp8's own noise (~25 dB), not more
    assert all(sqnr(grads[0][n], grads[1][n]) > 15 for n in grads[0])
    le, lc = _run(*eager, eager[0], range(3)), _run(*comp, fwd, range(3))
    assert all(abs(a - b) < 0.01 * a for a, b in zip(le, lc))
