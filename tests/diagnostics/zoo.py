"""A zoo of small models with planted mixed-precision faults, each a ``mixprec.tasks.Task``.

Each factory names the module that holds the fault (``FAULTS``) and the cause the guard and
``mixprec doctor`` must report. Run one with ``mixprec doctor --task tests.diagnostics.zoo:make_log_zero``.

The faults are the classic ones from the seeds' checklist: a loss taking log(0) because softmax
flushed to zero in fp16, a hand-written LayerNorm whose variance underflows in fp16, attention
logits past fp16's maximum, gradients that flush to zero without (enough) loss scaling, and a NaN
that fp32 has too.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.tasks import Task

# factory name -> (module that holds the fault, cause code doctor and the guard report)
FAULTS: dict[str, tuple[str, str]] = {
    "make_log_zero": ("criterion", "log-of-zero"),
    "make_tiny_variance_norm": ("norm", "division-by-zero"),
    "make_attention_overflow": ("attn", "matmul-overflow"),
    "make_deep_narrow": ("layers.0", "gradient-underflow"),
    "make_nan_in_fp32": ("features", "sqrt-of-negative"),
}


def _batches(n_in: int, n_out: int, batch: int, seed: int, classes: bool = True):
    def get_batch(step: int):
        g = torch.Generator().manual_seed(seed * 7919 + step)
        x = torch.randn(batch, n_in, generator=g)
        y = torch.randint(0, n_out, (batch,), generator=g) if classes else torch.randn(batch, n_out, generator=g)
        return x, y

    return get_batch


# ---------------------------------------------------------------- log(0) in a hand-written loss


class SoftmaxLogLoss(nn.Module):
    """Cross-entropy written as log(softmax(x)): in fp16 small probabilities flush to 0, log(0) = -inf,
    and 0 * -inf = NaN for every class that is not the target."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = logits.softmax(-1)
        return -(p.log() * F.one_hot(target, logits.size(-1))).sum(-1).mean()


class ClassifierWithLoss(nn.Module):
    """Returns its own loss, as many model libraries do (``model(x, labels=y)``)."""

    def __init__(self, n_in: int = 16, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        with torch.no_grad():
            self.head.weight.mul_(20.0)  # confident logits: gaps of ~20-40 between classes
        self.criterion = SoftmaxLogLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.head(self.body(x)), y)


def make_log_zero() -> Task:
    get = _batches(16, 10, 32, seed=1)
    return Task(
        name="zoo-log-zero",
        build_model=ClassifierWithLoss,
        get_batch=lambda step: (get(step), None),
        loss_fn=lambda out, _: out,
        forward=lambda model, inputs: model(*inputs),
        steps=20,
        description="a model computing its own loss as log(softmax(x)): log(0) once fp16 flushes probabilities",
    )


# ---------------------------------------------------------------- LayerNorm variance underflow


class HandStandardize(nn.Module):
    """A LayerNorm written by hand with BERT's eps=1e-12: in fp16 the squared deviations of small
    activations flush to 0, eps rounds to 0, and (x - mean) / sqrt(0) divides by zero. Named so
    that mixprec's norms rule cannot know it for a norm (a class named ...Norm would be made an
    fp32 island, and the fault would not happen)."""

    def __init__(self, d: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class SmallActivationNet(nn.Module):
    def __init__(self, n_in: int = 16, d: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(n_in, d)
        with torch.no_grad():
            self.proj.weight.mul_(1e-4)  # activations ~1e-5: squared deviations ~1e-10
            self.proj.bias.zero_()
        self.norm = HandStandardize(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def _classifier(name: str, build, n_in: int, classes: int, seed: int, description: str) -> Task:
    return Task(name=name, build_model=build, get_batch=_batches(n_in, classes, 32, seed=seed),
                loss_fn=F.cross_entropy, steps=20, description=description)


def make_tiny_variance_norm() -> Task:
    return _classifier("zoo-tiny-variance-norm", SmallActivationNet, 16, 8, 2,
                       "a hand-written LayerNorm (eps=1e-12) over activations ~1e-5: variance underflows in fp16")


# ---------------------------------------------------------------- attention logits past 65504


class SelfAttention(nn.Module):
    def __init__(self, d: int = 32, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T): the product passes 65504
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class LoudAttentionModel(nn.Module):
    def __init__(self, n_in: int = 8, d: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(n_in, d)
        self.attn = SelfAttention(d)
        self.head = nn.Linear(d, classes)
        with torch.no_grad():
            self.embed.weight.mul_(30.0)  # large residual stream: q.k reaches ~1e5
            self.attn.qkv.weight.mul_(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, C)
        return self.head(self.attn(h)[:, -1])


def make_attention_overflow() -> Task:
    def get_batch(step: int):
        g = torch.Generator().manual_seed(3 * 7919 + step)
        return torch.randn(8, 12, 8, generator=g), torch.randint(0, 8, (8,), generator=g)

    return Task(
        name="zoo-attention-overflow",
        build_model=LoudAttentionModel,
        get_batch=get_batch,
        loss_fn=F.cross_entropy,
        steps=20,
        description="attention over a loud residual stream: q @ k.T passes fp16's 65504",
    )


# ---------------------------------------------------------------- gradients below fp16's floor


class DeepNarrow(nn.Module):
    """Twelve 8-wide tanh layers with small weights: the gradient shrinks ~10x per layer, so the
    first layers' gradients (~1e-12 under a loss weighted 1e-3) sit below fp16's smallest subnormal
    (2**-24 ~ 6e-8) even times the default loss scale 2**16; a scale near 2**28 saves them."""

    def __init__(self, width: int = 8, depth: int = 12, gain: float = 0.25) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        with torch.no_grad():
            for layer in self.layers:
                nn.init.normal_(layer.weight, std=gain / math.sqrt(width))
                layer.bias.normal_(std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def make_deep_narrow() -> Task:
    return Task(
        name="zoo-deep-narrow",
        build_model=DeepNarrow,
        get_batch=_batches(8, 8, 32, seed=4, classes=False),
        loss_fn=lambda out, y: 1e-3 * F.mse_loss(out, y),  # an auxiliary-weight loss: small gradients
        build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        steps=20,
        max_grad_norm=None,
        description="a deep narrow tanh net: early-layer gradients flush to zero in fp16 without enough loss scale",
    )


# ---------------------------------------------------------------- a NaN that is not fp16's fault


class SqrtFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - 0.5)  # a "distance" feature; negative for half of the inputs: NaN


class NanEverywhere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = SqrtFeatures()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_nan_in_fp32() -> Task:
    return _classifier("zoo-nan-in-fp32", NanEverywhere, 16, 4, 5,
                       "sqrt of a negative number: NaN in fp32 too (not a precision fault)")


# ---------------------------------------------------------------- healthy


def make_healthy_mlp() -> Task:
    return _classifier("zoo-healthy-mlp",
                       lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)),
                       16, 4, 6, "a small healthy MLP")
