"""Tasks with planted precision faults, for the verdict's end-to-end tests (tiny: a few seconds each).

- ``make_underflow_task``: a deep narrow MLP whose gradients lie below fp16's subnormal floor
  (smallest in the early layers). fp32 trains as usual; fp16 *without* loss scaling flushes the
  gradients to zero and stops learning; fp16 with dynamic loss scaling shifts them back into range.
- ``make_vanishing_task``: a wide linear layer with updates ~1e-3 of its weights. ``masters=False`` rounds every
  parameter to bf16 after each optimizer step: 16-bit weights with no fp32 master copy, so
  updates smaller than half a bf16 spacing of the weight vanish.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.tasks import Task

WIDTH, OUT, BATCH = 16, 4, 64


def _teacher_batch(step: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    # a fixed smooth teacher; inputs drawn from a generator seeded by the step (same data in every run)
    w_teacher = torch.randn(width, OUT, generator=torch.Generator().manual_seed(0)) / width**0.5
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(10_000 + step))
    return x, torch.sin(2 * x @ w_teacher)


def _mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, OUT))
    return nn.Sequential(*layers)


#: Multiplies the loss, as a down-weighted auxiliary loss (or a sum normalised by millions of
#: elements) does: at 2e-5 the early layers' weight gradients are ~3e-9, under half of fp16's
#: smallest subnormal (2**-24 ~ 6e-8), so they round to zero in fp16.
LOSS_WEIGHT = 2e-5


def make_underflow_task(steps: int = 120, depth: int = 8, loss_weight: float = LOSS_WEIGHT) -> Task:
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_weight * nn.functional.mse_loss(out, target)

    return Task(
        name="deep-narrow-underflow",
        build_model=lambda: _mlp(WIDTH, depth),
        get_batch=_teacher_batch,
        loss_fn=loss_fn,
        # eps far below the squared gradients keeps Adam scale-invariant: fp32 trains as at weight 1
        build_optimizer=lambda params: torch.optim.Adam(params, lr=3e-3, eps=1e-30),
        steps=steps,
        max_grad_norm=None,
        description=f"MLP {depth}x{WIDTH} tanh, loss x {loss_weight:g}",
    )


class RoundToBf16(torch.optim.Optimizer):
    """Wraps an optimizer; after each step stores every parameter rounded to bf16 (kept in an fp32
    tensor), which is what 16-bit weights without an fp32 master copy amount to."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state  # one set of groups and state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        result = self.inner.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(p.to(torch.bfloat16).float())
        return result


#: A wide linear layer learning a fixed teacher. Weights ~ N(0, 1) and Adam's steps of about
#: ``lr`` = 1e-3 make each update ~1e-3 of its weight: under bf16's half spacing (2**-9 relative),
#: so it rounds away unless an fp32 master copy accumulates it. Width keeps fp32's seed-to-seed
#: spread small (the loss is an average over 8k weights), so the band is narrow and honest.
IN_WIDE, OUT_WIDE, WIDE_BATCH = 256, 64, 256


def _wide_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(IN_WIDE, OUT_WIDE, generator=torch.Generator().manual_seed(0))
    x = torch.randn(WIDE_BATCH, IN_WIDE, generator=torch.Generator().manual_seed(20_000 + step)) / IN_WIDE**0.5
    return x, x @ teacher


def make_vanishing_task(steps: int = 200, masters: bool = True, lr: float = 1e-3) -> Task:
    def build_model() -> nn.Module:
        model = nn.Linear(IN_WIDE, OUT_WIDE, bias=False)
        with torch.no_grad():
            model.weight.normal_()  # from the global seed, like any init
            if not masters:  # the weights start out in bf16 too
                model.weight.copy_(model.weight.to(torch.bfloat16).float())
        return model

    def build_optimizer(params):  # type: ignore[no-untyped-def]
        opt = torch.optim.Adam(params, lr=lr)
        return opt if masters else RoundToBf16(opt)

    return Task(
        name="wide-linear" + ("" if masters else "-bf16-weights"),
        build_model=build_model,
        get_batch=_wide_batch,
        loss_fn=nn.functional.mse_loss,
        build_optimizer=build_optimizer,
        steps=steps,
        max_grad_norm=None,
        description=f"linear {IN_WIDE}->{OUT_WIDE} to a teacher, Adam lr {lr:g}"
        + ("" if masters else ", weights rounded to bf16 after each step"),
    )


#: Raw, unnormalised features (counts, timestamps) of this size: fine in fp32 and bf16, past fp16's
#: largest finite value (65504) the moment autocast casts them for the first matmul.
RAW_FEATURE_SCALE = 2e5


def _raw_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _teacher_batch(step)
    return x * RAW_FEATURE_SCALE, y


def make_overflow_task(steps: int = 40) -> Task:
    return Task(
        name="raw-features-overflow",
        # the LayerNorm (an fp32 island) rescales the huge first-layer outputs, so fp32 trains
        build_model=lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT)),
        get_batch=_raw_batch,
        loss_fn=nn.functional.mse_loss,
        build_optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
        steps=steps,
        max_grad_norm=None,
        description=f"MLP on raw features of size ~{RAW_FEATURE_SCALE:g}",
    )
