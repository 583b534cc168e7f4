"""A tiny GPT and a training loop shared by the master-weight tests."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.tasks.charlm import CharGPT, lm_loss

STORAGE_RECIPES = ["bf16-true", "fp16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def tiny_gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CharGPT(d_model=32, n_layer=1, n_head=2, seq_len=16)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 96, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def setup(recipe: str, seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
          device: str = "cpu", build: Callable[[int], nn.Module] = tiny_gpt,
          **mp_kwargs: Any) -> tuple[nn.Module, MixedPrecision, torch.optim.Optimizer]:
    mp = MixedPrecision(recipe, device, **mp_kwargs)
    model = mp.prepare(build(seed).to(device))
    make = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1))
    return model, mp, make(mp.parameters(model))


def train(model: nn.Module, mp: MixedPrecision, opt: torch.optim.Optimizer, steps: range,
          poison: set[int] = frozenset(), **step_kwargs: Any) -> list[Any]:
    """Run ``steps``; in a step listed in ``poison`` the loss is multiplied by inf (a skipped step)."""
    stats = []
    for step in steps:
        for micro in range(mp.accumulate):
            x, y = (t.to(mp.device) for t in batch(step * mp.accumulate + micro))
            with mp.autocast():
                out = model(x)
            loss = lm_loss(out, y)
            if step in poison:
                loss = loss * float("inf")
            stats.append(mp.step(loss, opt, **step_kwargs))
    return stats


def snapshot(model: nn.Module, mp: MixedPrecision, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a run holds, deep-copied through torch.save (as a checkpoint would be)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, path: str = "") -> None:
    """Nested dicts/lists of tensors and values equal bit for bit (NaNs in the same places)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.is_floating_point():
            a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def without_generators(state: dict[str, Any]) -> dict[str, Any]:
    state = copy.deepcopy(state)
    state.get("mp", {}).get("masters", {}).pop("generators", None)
    return state


def assert_resume_bitwise(make: Callable[[], tuple[nn.Module, MixedPrecision, torch.optim.Optimizer]],
                          first: range, then: range,
                          make_fresh: Callable[[], tuple[nn.Module, MixedPrecision, torch.optim.Optimizer]] | None = None,
                          ) -> None:
    """Train ``first`` then ``then``; a fresh run (``make_fresh``, default ``make``) loaded from the
    checkpoint taken after ``first`` must end ``then`` bit for bit where the uninterrupted run did."""
    model, mp, opt = make()
    train(model, mp, opt, first)
    ckpt = snapshot(model, mp, opt)
    train(model, mp, opt, then)
    expected = snapshot(model, mp, opt)
    model2, mp2, opt2 = (make_fresh or make)()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    mp2.load_state_dict(ckpt["mp"])
    train(model2, mp2, opt2, then)
    assert_bitwise_equal(expected, snapshot(model2, mp2, opt2))
