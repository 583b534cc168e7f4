"""Task factories that break the protocol in one way each, for the error-message tests."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.tasks import Task


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _task(**overrides) -> Task:
    fields = dict(name="tiny", build_model=lambda: nn.Linear(4, 2), get_batch=_batch,
                  loss_fn=nn.functional.mse_loss, steps=12, max_grad_norm=None)
    fields.update(overrides)
    return Task(**fields)


def healthy() -> Task:
    return _task()


def not_a_task() -> dict:
    return {"model": nn.Linear(4, 2)}


def model_is_not_a_module() -> Task:
    return _task(build_model=lambda: "a string")


def batch_is_not_a_pair() -> Task:
    return _task(get_batch=lambda step: torch.zeros(8, 4))


def batches_follow_the_global_seed() -> Task:
    return _task(get_batch=lambda step: (torch.randn(8, 4), torch.randn(8, 2)))


def loss_is_not_a_scalar() -> Task:
    return _task(loss_fn=lambda out, target: (out - target) ** 2)


def nan_in_fp32() -> Task:
    return _task(loss_fn=lambda out, target: nn.functional.mse_loss(out, target) * float("nan"))


class _NoHalfKernel(nn.Linear):
    """Stands in for an op without a 16-bit kernel on this device: raises under autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            raise RuntimeError("\"addmm_impl\" not implemented for 'Half'")
        return super().forward(x)


def fails_under_autocast() -> Task:
    return _task(build_model=lambda: _NoHalfKernel(4, 2))


def sized(width: int = 4) -> Task:
    return _task(build_model=lambda: nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))


def raises() -> Task:
    raise RuntimeError("the factory's own bug")
