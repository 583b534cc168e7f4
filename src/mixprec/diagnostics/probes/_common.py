"""What the probes share: where a value lands when cast to a format, and running a closure cleanly."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mixprec.formats import FloatFormat, get_format

DEFAULT_FORMATS = ("f16", "bf16", "e4m3", "e5m2")


def rounding_thresholds(fmt: FloatFormat) -> tuple[float, float, float]:
    """Magnitudes where round-to-nearest-even changes category, for ``fmt``.

    Returns (zero, normal, overflow): a magnitude ``a`` becomes 0 when ``a <= zero`` (half the
    smallest subnormal rounds to the even neighbour, 0), stays subnormal when ``zero < a < normal``
    (just below ``tiny`` a value rounds up to it once within half a subnormal step), and overflows
    when ``a >= overflow`` (``max`` plus half its ulp; exactly halfway rounds to the even side, past max).
    For e4m3fn, which has no infinity, "overflow" means the cast saturates or gives NaN.
    """
    half_sub = fmt.smallest_subnormal / 2
    ulp_max = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    return half_sub, fmt.tiny - half_sub, fmt.max + ulp_max / 2


def formats(names: Sequence[str]) -> list[FloatFormat]:
    return [get_format(n) for n in names]


def pow2_label(scale: float) -> str:
    """``65536.0`` -> ``2^16``; other values as they are."""
    if scale > 0:
        k = math.log2(scale)
        if k == int(k):
            return f"2^{int(k)}"
    return f"{scale:g}"


class GradSnapshot:
    """Set aside a model's ``.grad`` tensors and put them back, so a probe leaves no trace."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.saved = [p.grad for p in self.params]

    def clear(self) -> None:
        for p in self.params:
            p.grad = None

    def restore(self) -> None:
        for p, g in zip(self.params, self.saved):
            p.grad = g


def run_backward(closure: Callable[[], torch.Tensor], what: str) -> torch.Tensor:
    loss = closure()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"{what}: the closure must return the scalar loss as a tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError(f"{what}: the loss does not require grad (computed under torch.no_grad()?)")
    loss.backward()
    return loss


def check_args(probe: str, model: object, closure: object, optimizer: object = None) -> None:
    """A clear TypeError for arguments in the wrong place or of the wrong kind."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{probe} takes the model (an nn.Module) first, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{probe} takes the optimizer (a torch.optim.Optimizer) second, got {type(optimizer).__name__}")
    if not callable(closure):
        raise TypeError(f"{probe} takes a closure that runs the forward and returns the loss, e.g. "
                        f"lambda: loss_fn(model(x), y); got {type(closure).__name__}")
