"""What the fp8 tests share: one fp8 linear made directly, a tiny GPT, a training loop, SQNR."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.fp8.linear import Fp8Config, Fp8Linear
from mixprec.fp8.swap import convert_
from mixprec.recipes import Fp8Spec
from mixprec.tasks.charlm import CharGPT, lm_loss

FP8_RECIPES = ("fp8-current", "fp8-delayed")
#: torchao's numerics gates (test/float8): a cast >= 25 dB, a linear's output and gradients >= 20 dB
CAST_DB, LINEAR_DB = 25.0, 20.0


def fp8_linear(in_features: int = 64, out_features: int = 32, seed: int = 0, backend: str = "emulate",
               history: int = 16, bias: bool = True, **spec: Any) -> Fp8Linear:
    """An ``nn.Linear`` (seeded) swapped to fp8 with ``Fp8Spec(**spec)`` (current scaling by default)."""
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    return convert_(lin, Fp8Config.from_spec(Fp8Spec(**spec), backend), "lin", history)


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    from mixprec.fp8 import sqnr_db

    return sqnr_db(ref, approx)


def tiny_gpt(seed: int = 0, d_model: int = 32, n_layer: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return CharGPT(vocab=96, d_model=d_model, n_layer=n_layer, n_head=2, seq_len=16)


def batch(step: int, b: int = 4, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 96, (b, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(model: nn.Module, mp: MixedPrecision, opt: torch.optim.Optimizer, steps: range,
          poison: set[int] = frozenset()) -> list[float]:
    """``len(steps)`` steps on fixed batches; at a step in ``poison`` the loss is made inf."""
    losses = []
    for step in steps:
        x, y = batch(step)
        with mp.autocast():
            loss = lm_loss(model(x), y)
        if step in poison:
            loss = loss * float("inf")
        losses.append(float(mp.step(loss, opt, max_grad_norm=1.0).loss))
    return losses


def build(recipe: str, seed: int = 0, **mp_kwargs: Any) -> tuple[nn.Module, MixedPrecision, torch.optim.Optimizer]:
    model = tiny_gpt(seed)
    mp = MixedPrecision(recipe, "cpu", **mp_kwargs)
    mp.prepare(model)
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
    return model, mp, opt


def roundtrip(obj: Any) -> Any:
    """Through torch.save / torch.load, as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(copy.deepcopy(obj), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
