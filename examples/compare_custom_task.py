"""Judge mixed precision on your own model: the task protocol of ``mixprec compare``, by example.

A task factory returns a ``mixprec.tasks.Task``: how to build the model, which batch each step
trains on, and the loss. ``compare`` builds the model once per run (after seeding torch, so that
fp32 from other seeds can measure the noise), moves batches to the device, and trains each recipe
with ``MixedPrecision``. Run it either way:

    mixprec compare --task examples.compare_custom_task:make_task      # from the repository root
    python examples/compare_custom_task.py                              # the same, from Python

The model here classifies points on two interleaved spirals; swap in your own.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.tasks import Task


def spirals(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of points on two spirals, labelled by spiral. Seeded by the step, so every run
    (every recipe and seed) trains on the same batches; never use the global RNG here."""
    g = torch.Generator().manual_seed(7_000 + step)
    label = torch.randint(0, 2, (batch_size,), generator=g)
    t = torch.rand(batch_size, generator=g) * 3 * math.pi + 0.5  # angle along the spiral
    angle = t + label * math.pi
    points = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
    return points + 0.02 * torch.randn(batch_size, 2, generator=g), label


class SpiralNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, width), nn.GELU(),
            nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),  # norms become fp32 islands
            nn.Linear(width, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2) -> (B, 2) logits
        return self.net(x)


def make_task(steps: int = 150, batch_size: int = 128, width: int = 64, lr: float = 1e-2) -> Task:
    """Keyword arguments become ``--task-arg KEY=VALUE`` on the command line."""
    return Task(
        name="spirals",
        build_model=lambda: SpiralNet(width),  # fresh, fp32, on the CPU: compare moves it
        get_batch=lambda step: spirals(step, batch_size),  # (inputs, targets); nests of tensors work too
        loss_fn=F.cross_entropy,  # (outputs, targets) -> scalar; runs outside autocast, in fp32
        build_optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        steps=steps,
        max_grad_norm=1.0,  # clipped after unscaling, by MixedPrecision.step
        description=f"MLP 2-{width}-{width}-2 on two spirals, batch {batch_size}",
    )


def main(steps: int | None = None, out: str = "mixprec-report/spirals") -> int:
    import mixprec

    result = mixprec.compare(make_task, recipes=("bf16-mixed", "fp16-mixed"), steps=steps, out=out)
    for name, verdict in result.verdicts.items():
        print(f"{name:12s} {verdict.status:10s} {result.step_time_ratio(name):5.2f}x fp32 step time  {verdict.message}")
    print(f"report: {result.files['html']}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
