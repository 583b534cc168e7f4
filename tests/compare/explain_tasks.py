"""Tasks with one planted cause each, for ``compare --explain`` (tiny: seconds per run on 2 cores).

Importable as ``explain_tasks:make_...`` (tests/ and tests/compare/ are on the path), so that
``--jobs`` workers can import them too.

- ``make_variance_task``: a hand-written normalisation (``Standardize``, not a class the recipes
  know as a norm) computes its variance as E[x^2] - E[x]^2 in the dtype it receives. Its input has
  a mean of ~8 and a spread of ~0.5: in bf16 (spacing 0.5 at 64) the two terms cancel to 0 or to
  noise, in fp32 they do not. Planted in ``blocks.1.std`` only. ``projected=True``: the norm has a
  projection of its own that feeds the variance (``ProjectedStandardize``).
- ``make_long_sum_task``: a running mean over a sequence computed as a running sum, one add per
  position, in the dtype it receives (a scan written as a loop). In bf16 the sum reaches ~300,
  where the spacing is 2: each add of ~3 rounds by up to a third of itself. Planted in ``mix``.
- ``make_attention_task``: an attention whose query/key projections carry a large gain (as a model
  trained in fp32 with unnormalised q/k ends up with): the logits q.k pass 65504, inf in fp16, and
  softmax makes NaN. In fp32 and bf16 the softmax only saturates. Planted in ``attn``.
- ``FP16_SCALE1`` with ``compare_faults.make_underflow_task``: fp16 with a static loss scale of
  1: the gradients (~1e-9) flush to zero. A scale stuck low.
- the built-in ``fragile`` task under ``bf16-pure``: updates ~1e-3 of the weights vanish in bf16
  storage without masters.
- ``make_unstable_task``: a learning rate that makes fp32 itself blow up.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from mixprec import get_recipe
from mixprec.tasks import Task

#: fp16 with a static loss scale of 1: a scale stuck at a low value
FP16_SCALE1 = dataclasses.replace(get_recipe("fp16-mixed"), name="fp16-scale1", loss_scaling="static",
                                  static_scale=1.0, description="fp16 autocast, static loss scale 1")


def _regression_batch(step: int, d_in: int, d_out: int, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(0)) / d_in**0.5
    x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(10_000 + step))
    return x, torch.tanh(2 * x @ teacher)


class Standardize(nn.Module):
    """(x - mean) / std over the last dimension, the variance as E[x^2] - E[x]^2, in the input's dtype.

    A hand-written normalisation: no weight, a name no norm rule matches, so no recipe makes it an
    island. The variance is clamped at 0 (rounding can make it negative)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-4)


class ProjectedStandardize(Standardize):
    """``Standardize`` after a fixed projection of its own that adds the offset: it receives the fp32
    residual stream, its projection computes in the autocast dtype and feeds the 16-bit variance.
    Making the projection an island feeds the variance in fp32, so the search's smallest set is
    ``std.proj``, while the fault is the reduction in ``std``'s own code."""

    def __init__(self, width: int, offset: float) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(width))
            self.proj.bias.fill_(offset)
        self.proj.requires_grad_(False)  # a fixed map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.proj(x))


class Block(nn.Module):
    def __init__(self, width: int, planted: bool, offset: float = 8.0, projected: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        with torch.no_grad():  # activations of mean ~offset: the cancellation that bf16 cannot survive
            self.fc.bias.fill_(offset if planted else 0.0)
            self.fc.weight.mul_(0.5)
        if planted and projected:  # the offset is the norm's own: its input is the fp32 residual stream (below)
            with torch.no_grad():
                self.fc.bias.zero_()
        self.projected = planted and projected
        self.std = ((ProjectedStandardize(width, 4 * offset) if projected else Standardize()) if planted
                    else nn.LayerNorm(width, elementwise_affine=False))
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.projected:
            return x + self.act(self.std(x.float() + self.fc(x)))  # (an island hands back the dtype it got: fp32)
        return x + self.act(self.std(self.fc(x)))


class Net(nn.Module):
    def __init__(self, width: int, depth: int, planted: int, d_in: int = 16, d_out: int = 4,
                 projected: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width, i == planted, projected=projected) for i in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_variance_task(steps: int = 60, width: int = 32, depth: int = 3, planted: int = 1,
                       projected: bool = False) -> Task:
    return Task(
        name="planted-variance",
        build_model=lambda: Net(width, depth, planted, projected=projected),
        get_batch=lambda step: _regression_batch(step, 16, 4),
        loss_fn=nn.functional.mse_loss,
        build_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
        steps=steps,
        max_grad_norm=1.0,
        description=f"residual MLP {depth}x{width}; blocks.{planted}.std: variance as E[x^2]-E[x]^2 in 16 bits",
    )


class RunningMean(nn.Module):
    """out[:, t] = mean(x[:, :t+1]) as a running sum, one add per position, in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        acc = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            acc = acc + x[:, t]
            outs.append(acc / (t + 1))
        return torch.stack(outs, dim=1)


class SeqNet(nn.Module):
    """Starts near the answer (head(mean(inp(x)))) = mean(x)), as a fine-tuning run does, the seed
    moving it by 5%: fp32 then converges alike from every seed, and the band is narrow."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(1, d)
        self.mix = RunningMean()
        self.head = nn.Linear(d, 1)
        with torch.no_grad():
            self.inp.weight.copy_(1 + 0.05 * torch.randn(d, 1))
            self.inp.bias.copy_(0.05 * torch.randn(d))
            self.head.weight.copy_((1 + 0.05 * torch.randn(1, d)) / d)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 1) -> (B, T, 1)
        return self.head(self.mix(self.inp(x)))


def make_long_sum_task(steps: int = 60, seq: int = 128) -> Task:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(30_000 + step)
        x = 3.0 + 0.5 * torch.randn(16, seq, 1, generator=g)  # values ~3: the running sum grows to ~3 seq
        running = x.cumsum(1) / torch.arange(1, seq + 1).view(1, seq, 1)
        return x, running  # the model must compute the running mean
    return Task(
        name="planted-long-sum",
        build_model=lambda: SeqNet(),
        get_batch=batch,
        loss_fn=nn.functional.mse_loss,
        build_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        steps=steps,
        max_grad_norm=1.0,
        description=f"running mean over {seq} positions as a running sum in 16 bits (mix)",
    )


class Attention(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.gain = gain  # large-norm queries and keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        q, k = self.q(x) * self.gain, self.k(x) * self.gain
        att = (q @ k.transpose(-2, -1)) / math.sqrt(x.shape[-1])  # (B, T, T): past 65504 in fp16
        return att.softmax(-1) @ self.v(x)


class AttnNet(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 16, gain: float = 150.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = Attention(d, gain)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h + self.attn(h))


def make_attention_task(steps: int = 40, gain: float = 150.0) -> Task:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(40_000 + step)
        x = torch.randint(0, 16, (8, 12), generator=g)
        return x, (x + 1) % 16  # the next symbol
    return Task(
        name="planted-attention-overflow",
        build_model=lambda: AttnNet(gain=gain),
        get_batch=batch,
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
        build_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
        steps=steps,
        max_grad_norm=1.0,
        description=f"attention with q/k gain {gain:g}: logits past fp16's max (attn)",
    )


def make_unstable_task(steps: int = 40, lr: float = 5.0) -> Task:
    return Task(
        name="unstable-in-fp32",
        build_model=lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
        get_batch=lambda step: _regression_batch(step, 16, 4),
        loss_fn=nn.functional.mse_loss,
        build_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        steps=steps,
        max_grad_norm=None,
        description=f"SGD lr {lr:g} with momentum, no clipping: fp32 itself blows up",
    )


def make_loss16_task(steps: int = 40, size: float = 300.0) -> Task:
    """A regression whose targets are ~``size`` (prices, counts) and whose loss casts the targets to
    the output's dtype, a common way to silence a dtype mismatch. Under a policy that hands the
    loss 16-bit outputs (jmp's ``p=f32,c=f16``: the output defaults to the compute dtype), the
    squared errors (~1e5 at the start) pass 65504 and the mean is inf in fp16."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _regression_batch(step, 16, 4)
        return x, size * (1 + y)

    return Task(
        name="planted-loss-in-16-bits",
        build_model=lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
        get_batch=batch,
        loss_fn=lambda out, y: nn.functional.mse_loss(out, y.to(out.dtype)),
        build_optimizer=lambda p: torch.optim.Adam(p, lr=3e-2),
        steps=steps,
        max_grad_norm=1.0,
        description=f"regression to targets ~{size:g}, the loss in the output's dtype",
    )


# ---------------------------------------------------------------------------- found by a probe of --explain


def _classes(step: int, d_in: int = 16, n_cls: int = 4, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(1000 + step))
    return x, x[:, :n_cls].argmax(1)


class ManualSoftmax(nn.Module):
    """exp / sum, in the dtype it receives: large logits overflow fp16's exp. No parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


class TokenMixer(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.sm, self.gain = ManualSoftmax(), gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.sm((self.q(x) @ self.k(x).transpose(1, 2)) * self.gain) @ self.v(x)


class SoftmaxNet(nn.Module):
    def __init__(self, gain: float, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(1, d)
        self.blocks = nn.ModuleList([TokenMixer(d, 1.0), TokenMixer(d, gain)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.unsqueeze(-1))
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


def make_two_softmax_task(steps: int = 40, gain: float = 3.0) -> Task:
    """Two hand-written softmaxes; the island set that fixes fp16 is both, ranked out of forward order."""
    return Task(name="manual-softmax", build_model=lambda: SoftmaxNet(gain), get_batch=lambda s: _classes(s, d_in=8),
                loss_fn=nn.functional.cross_entropy, build_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                steps=steps, max_grad_norm=1.0, description="manual softmax in both blocks, a logit gain in block 1")


class LogSoftmaxHead(nn.Module):
    def __init__(self, d: int, n: int, gain: float) -> None:
        super().__init__()
        self.fc, self.gain = nn.Linear(d, n), gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(x) * self.gain, -1))


def make_log_softmax_task(steps: int = 40, gain: float = 30.0) -> Task:
    """log(softmax) in the head: under 16-bit storage the island is the head (parameters and all)."""
    build = lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),  # noqa: E731
                                  LogSoftmaxHead(32, 4, gain))
    return Task(name="log-softmax", build_model=build, get_batch=_classes, loss_fn=nn.functional.nll_loss,
                build_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), steps=steps, max_grad_norm=1.0,
                description="log(softmax) in the head")


class PositionsNet(nn.Module):
    """Positions read from a buffer (BERT's ``position_ids``: the embedding saves a view of it for backward)
    and a feed-forward whose gain overflows fp16."""

    def __init__(self, gain: float, d: int = 16, t: int = 8) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(t).unsqueeze(0), persistent=False)
        self.pos = nn.Embedding(t, d)
        self.inp = nn.Linear(1, d)
        self.ff = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.unsqueeze(-1)) + self.pos(self.positions[:, : x.shape[1]])
        return self.head(torch.relu(self.ff(h) * self.gain).mean(1) / self.gain)


def make_positions_task(steps: int = 40, gain: float = 1e5) -> Task:
    return Task(name="positions", build_model=lambda: PositionsNet(gain), get_batch=lambda s: _classes(s, d_in=8),
                loss_fn=nn.functional.cross_entropy, build_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                steps=steps, max_grad_norm=1.0, description="positions from a buffer, an fp16 overflow in ff")
