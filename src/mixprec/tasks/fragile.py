"""A built-in task where unsafe recipes visibly fail: what a failure looks like before you meet one.

    mixprec compare --task fragile --recipes bf16-mixed fp16-mixed bf16-true bf16-pure fp16-pure

A wide linear layer starts near a fixed linear teacher (the teacher plus noise of 0.05 per weight,
drawn from the run's seed) and learns to close the gap. Two things about it are common in real
models and harmless in fp32:

- **the loss is small**: it is multiplied by ``loss_weight`` (1e-4), as a down-weighted auxiliary
  loss or a sum normalised by millions of elements is. The gradient reaching the layer's output is
  then ~1e-8, below half of fp16's smallest subnormal (2**-24 ~ 6e-8): in fp16 it rounds to zero.
  Loss scaling (``fp16-mixed``: 2**16) lifts it back into range; ``fp16-pure`` has none and stops
  learning.
- **updates are small next to the weights**: weights ~N(0, 1) and Adam's steps of ~``lr`` (1e-3)
  make each update ~1e-3 of its weight, under bf16's half spacing (2**-9 of the value): stored in
  bf16 with no fp32 master (``bf16-pure``) the update rounds away; ``bf16-true``'s fp32 masters
  keep it.

Adam's ``eps`` is far below the squared gradients, so the tiny loss weight does not change what
fp32 learns (Adam divides the gradient's scale out). fp32, ``bf16-mixed``, ``fp16-mixed`` and
``bf16-true`` TRACK; ``bf16-pure`` and ``fp16-pure`` stay near where they started and DIVERGE.
About 15 s on two CPU cores.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.tasks import Task

IN, OUT, BATCH = 256, 64, 256


def _teacher() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))  # (OUT, IN), like a Linear's weight


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(20_000 + step)) / IN**0.5  # (B, IN)
    return x, x @ _teacher().T


def make_task(steps: int = 100, loss_weight: float = 1e-4, lr: float = 1e-3, gap: float = 0.05) -> Task:
    """The fragile task; ``loss_weight=1`` removes the fp16 underflow (fp16-pure then fails only
    by rounding), a larger ``lr`` lets bf16-pure's updates survive."""
    for name, value in (("loss_weight", loss_weight), ("lr", lr), ("gap", gap)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"fragile task: {name} must be a number > 0, got {value!r}")

    def build_model() -> nn.Module:
        model = nn.Linear(IN, OUT, bias=False)
        with torch.no_grad():  # weights ~1 (so updates of ~lr are ~1e-3 of them), ``gap`` from the teacher
            model.weight.copy_(_teacher() + gap * torch.randn(OUT, IN))
        return model

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_weight * nn.functional.mse_loss(out.float(), target)

    return Task(
        name="fragile",
        build_model=build_model,
        get_batch=_batch,
        loss_fn=loss_fn,
        build_optimizer=lambda params: torch.optim.Adam(params, lr=lr, eps=1e-30),
        steps=steps,
        max_grad_norm=None,
        description=f"linear {IN}->{OUT} to a teacher, loss x {loss_weight:g}, Adam lr {lr:g}: "
                    "fp16 without loss scaling and 16-bit weights without masters fail here",
    )
