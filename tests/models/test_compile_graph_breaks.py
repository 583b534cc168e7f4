"""torch.compile of a model prepared for a 16-bit storage recipe, with graph breaks (issue 29.2: the
forward wrapper that enters autocast outside mp.autocast() recursed until RecursionError as soon as
dynamo resumed after a break; HF GPT-2's ``labels=`` path has three breaks, its logging).

The default-suite tests compile with dynamo's ``eager`` backend: the recursion was dynamo's (how it
resumed after the break), and ``eager`` runs the captured graphs with the very ops eager mode runs,
so the results must match eager bit for bit. The real compile (inductor) of HF GPT-2 is slow-marked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision

STORAGE = ("bf16-true", "fp16-true", "bf16-true-kahan",
           *(pytest.param(r, marks=pytest.mark.slow) for r in ("bf16-true-sr", "bf16-true-remainder", "bf16-pure",
                                                                "fp16-pure")))


class Broken(nn.Module):
    """Two matmuls and a norm with a graph break between them, as a logging call makes one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x))
        torch._dynamo.graph_break()
        return self.b(torch.relu(h))


def _pair(recipe: str):
    """The same prepared model twice (same seed): one to compile, one to run eagerly."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        mp = MixedPrecision(recipe, "cpu")
        out.append((mp, mp.prepare(Broken())))
    return out


@pytest.mark.parametrize("recipe", STORAGE)
def test_a_graph_break_compiles_and_matches_eager_inside_and_outside_autocast(recipe):
    torch._dynamo.reset()
    (mp, model), (_, eager) = _pair(recipe)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 16)
    with mp.autocast():  # training: the forward and its backward
        got, want = compiled(x), eager(x)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    got.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), n
    with torch.no_grad():  # evaluation outside mp.autocast(): the wrapper enters it, compiled too
        assert torch.equal(compiled(x), eager(x))
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16-true"])  # (~1-2 min of inductor compiling on 2 cores)
def test_hf_gpt2_with_labels_compiles_with_inductor_and_trains(recipe):
    from hf_zoo import batch, build

    torch._dynamo.reset()
    mps, models = [], []
    for _ in range(2):
        mp = MixedPrecision(recipe, "cpu")
        mps.append(mp)
        models.append(mp.prepare(build("gpt2")))
    compiled = torch.compile(models[0])  # inductor; GPT-2's labels= path breaks the graph (its logging)
    opts = [torch.optim.AdamW(mp.parameters(m), lr=1e-3) for mp, m in zip(mps, models)]
    for s in range(3):
        kw = batch("gpt2", s)
        losses = []
        for mp, m, opt in zip(mps, (compiled, models[1]), opts):
            with mp.autocast():
                loss = m(**kw).loss
            mp.step(loss, opt, max_grad_norm=1.0)
            losses.append(loss.item())
        # inductor fuses and reorders 16-bit arithmetic: the same loss to a few 16-bit roundings
        assert losses[0] == pytest.approx(losses[1], rel=2e-2), (s, losses)
    with torch.no_grad():  # and an evaluation call outside mp.autocast()
        kw = batch("gpt2", 9)
        got, want = compiled(**kw).logits, models[1](**kw).logits
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=5e-2, atol=5e-2)
