"""A tiny regression problem shared by the integration tests, and the hand-written mixprec loop
each framework's run is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision

N, D_IN, D_OUT, BATCH = 240, 8, 4, 8  # 30 batches


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, D_OUT))


def make_data(overflow_at: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets; the batches at ``overflow_at`` get inputs that overflow fp16 (1e6)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D_IN, generator=g)
    y = torch.randn(N, D_OUT, generator=g)
    for b in overflow_at:
        x[b * BATCH:(b + 1) * BATCH] *= 1e6
    return x, y


def batches(x: torch.Tensor, y: torch.Tensor, epochs: int = 1):
    for _ in range(epochs):
        for i in range(0, len(x), BATCH):
            yield x[i:i + BATCH], y[i:i + BATCH]


def make_optimizer(params, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def make_scheduler(opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)


def hand_loop(recipe: str, x, y, *, epochs: int = 1, max_grad_norm: float | None = None, accumulate: int = 1,
              scaler=None, net: nn.Module | None = None):
    """The reference: mp.step by hand. Returns (model, per-step StepStats as dicts, scheduler)."""
    mp = MixedPrecision(recipe, "cpu", accumulate=accumulate, **({"scaler": scaler} if scaler else {}))
    model = mp.prepare(make_net() if net is None else net)
    opt = make_optimizer(mp.parameters(model))
    sched = make_scheduler(opt)
    out = []
    for xb, yb in batches(x, y, epochs):
        with mp.autocast():
            loss = F.mse_loss(model(xb), yb)
        stats = mp.step(loss, opt, max_grad_norm=max_grad_norm, scheduler=sched)
        if stats.stepped:
            out.append(stats.to_dict())
    return model, out, sched


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]) for k in pa)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (NaN included): for fp32 tensors."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
