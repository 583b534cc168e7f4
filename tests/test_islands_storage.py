"""fp32 islands under the recipes that store parameters in 16 bits.

An island computes in fp32, so its own parameters stay fp32 (they were stored in 16 bits, and the
first forward failed with "self and mat2 must have the same dtype": every storage recipe, pure ones
included, crashed on any fp32_modules= that held a matmul)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision

STORAGE = ["bf16-true", "fp16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure", "fp16-pure"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("recipe", STORAGE)
def test_an_island_keeps_its_parameters_fp32_and_computes_what_fp32_computes(recipe):
    mp = MixedPrecision(recipe, "cpu", fp32_modules=["0"])
    ref = _net()
    model = mp.prepare(_net())
    assert model[0].weight.dtype == torch.float32 and model[0].bias.dtype == torch.float32
    assert model[2].weight.dtype == mp.policy.param_dtype  # the rest is stored as the recipe says
    x = torch.randn(5, 8)
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    with mp.autocast():
        model(x)
    # the island's input is what reached it (fp32, or the pure recipes' 16-bit input); from there, fp32
    # (a pure recipe casts the model's input to 16 bits, and the island's output back to them)
    x_in = x if not mp.recipe.pure else x.to(mp.policy.compute_dtype).float()
    assert seen["out"].dtype == (mp.policy.compute_dtype if mp.recipe.pure else torch.float32)
    assert torch.equal(seen["out"], ref[0](x_in).to(seen["out"].dtype))


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true", "bf16-true-kahan", "fp16-pure"])
def test_an_islands_parameters_train_and_resume_bit_for_bit(recipe):
    def run(steps, state=None):
        mp = MixedPrecision(recipe, "cpu", fp32_modules=["0"])
        model = mp.prepare(_net())
        opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            mp.load_state_dict(state["mp"])
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            with mp.autocast():
                out = model(x)
            mp.step(nn.functional.mse_loss(out, y), opt)
        return model, {"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}

    before = _net()[0].weight.detach().clone()
    straight, _ = run(range(6))
    assert not torch.equal(straight[0].weight, before)  # the island's weights were stepped
    _, half = run(range(3))
    resumed, _ = run(range(3, 6), state=half)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", STORAGE)
def test_an_island_without_parameters_and_the_whole_model_as_one(recipe):
    # found by a probe of compare --explain: an island that owns no parameter (a softmax module, a norm without
    # weights) became an fp32_params rule that matched nothing, and the masters refused it ("fp32_params rule
    # '1' matches no parameter"); bf16-true refused LayerNorm(elementwise_affine=False) that way, and explain's
    # whole-forward candidate ('' as the island) ended in that error
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16, elementwise_affine=False), nn.Softmax(-1), nn.Linear(16, 4))
    model = MixedPrecision(recipe, "cpu", fp32_modules=["2"]).prepare(net)
    assert model[0].weight.dtype != torch.float32 and model[3].weight.dtype != torch.float32
    whole = MixedPrecision(recipe, "cpu", fp32_modules=[""]).prepare(_net())
    assert all(p.dtype == torch.float32 for p in whole.parameters())
    x = torch.randn(5, 8)
    assert torch.isfinite(model(x)).all() and torch.isfinite(whole(x)).all()
