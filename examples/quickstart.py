"""The mixprec training loop on a small classifier: one loop, any recipe.

    python examples/quickstart.py                 # 'auto' picks for this machine
    python examples/quickstart.py fp16-mixed      # any recipe name or jmp policy string
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def main(recipe: str = "auto", steps: int = 60) -> float:
    torch.manual_seed(0)
    teacher = torch.randn(32, 10)
    data = [(x, (x @ teacher).argmax(-1)) for x in torch.randn(steps, 64, 32)]

    mp = mixprec.MixedPrecision(recipe, device="cpu")
    print(mp.describe())
    model = mp.prepare(nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    for x, y in data:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        stats = mp.step(loss, opt, max_grad_norm=1.0)
        losses.append(stats.loss)  # device tensors: no host sync inside the loop

    curve = torch.stack(losses)
    print(f"loss {curve[:5].mean():.3f} -> {curve[-5:].mean():.3f}; scaler skipped "
          f"{int(mp.scaler.skipped_steps) if mp.scaler.is_enabled() else 0} step(s)")
    return float(curve[-5:].mean())


if __name__ == "__main__":
    main(*sys.argv[1:2])
