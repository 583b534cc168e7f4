"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs take fp8 operands (and ``Fp8Matmul``, what it
shares with the fp8 form of Hugging Face's ``Conv1D``, ``mixprec.fp8.conv1d``).

Forward casts the input and the weight to fp8 with their scales and multiplies; backward casts the
output gradient (e5m2 under the hybrid format) and computes the input and weight gradients from fp8
operands with fp32 accumulation (``gemm``). The weight stays an fp32 parameter: its fp8 copy is
made in each forward and, with the fp8 input, saved for backward (1 byte per element; rowwise
scaling saves the high-precision tensors instead, since backward scales them along other axes).

The swap is done in place by ``mixprec.fp8.swap`` (the module's class becomes ``Fp8Linear``, its
parameters, hooks and state-dict keys are untouched); the scaling state of delayed scaling lives in
non-persistent buffers (``fp8_amax_history``, ``fp8_scale``), saved through ``mp.state_dict()``.

Observers (``mixprec.fp8.observe``) compose: ``fp8_observers`` is a tuple, every one of them sees
every cast, and each is removed alone.

Autocast: like ``F.linear``, the layer computes from the autocast dtype when autocast is on (the
input is cast to bf16 first, as torchao does) and returns that dtype; its own ops run with
autocast off. Under ``torch.compile`` the layer traces into one graph (no break; the amax
recordings are buffer mutations, in forward and in backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mixprec.fp8 import gemm
from mixprec.fp8.casts import FloatFormat, amax, amax_fmax, current_scale, role_formats
from mixprec.fp8.casts import quantize_raw as quantize
from mixprec.fp8.delayed import record_
from mixprec.fp8.weight_cache import ATTR as WEIGHT_CACHE
from mixprec.fp8.weight_cache import cast_weight


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """What one fp8 linear does, as constants (hashable: ``torch.compile`` treats it as one).

    Attributes: ``formats`` (input, weight, grad_output), ``scaling`` ("delayed", "current" or
    "none"), ``rowwise``, ``pow2`` (scales rounded down to powers of two), ``backend`` ("emulate"
    or "scaled_mm"), ``mx`` (MXFP8 block scaling, ``mixprec.fp8.mx``, with ``mx_mode``), ``cache_weight``
    (reuse the weight's fp8 cast within an accumulation window: ``mixprec.fp8.weight_cache``).
    """

    formats: tuple[FloatFormat, FloatFormat, FloatFormat]
    scaling: str
    rowwise: bool = False
    pow2: bool = False
    backend: str = "emulate"
    mx: bool = False
    mx_mode: str = "rceil"
    cache_weight: bool = True

    @classmethod
    def from_spec(cls, spec: Any, backend: str) -> "Fp8Config":
        return cls(role_formats(spec.format), spec.scaling, spec.granularity == "rowwise", spec.pow2_scales, backend,
                   spec.granularity == "mx", cache_weight=spec.cache_weight)

    def scale(self, t: torch.Tensor, role: int, dim: int | None, delayed: torch.Tensor | None) -> torch.Tensor:
        """The scale that casts ``t`` in ``role``: computed from ``t`` (current scaling, along ``dim``
        when rowwise), read from the delayed scales, or 1."""
        if self.scaling == "current":
            return current_scale(amax(t, dim if self.rowwise else None), self.formats[role], self.pow2)
        if self.scaling == "delayed":
            assert delayed is not None
            return delayed[role]
        return torch.ones((), device=t.device)


class _Fp8LinearFn(torch.autograd.Function):
    """``x @ w.T`` from fp8 operands; both gradients from fp8 operands (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor, sw: torch.Tensor,
                scales: torch.Tensor | None, history: torch.Tensor | None, cfg: Fp8Config,
                observers: tuple) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        fx, fw, _ = cfg.formats
        sx = cfg.scale(x2, 0, -1, scales)
        x_q = quantize(x2, sx, fx)  # (the weight's cast comes in: ``weight_cache``)
        for obs in observers:
            obs.cast(0, x2, x_q, sx, fx)
            obs.cast(1, weight, w_q, sw, fw)
        out = gemm.output(x_q, sx, w_q, sw, x.dtype, cfg.backend)
        if cfg.rowwise:  # backward scales along other axes: keep the high-precision tensors
            ctx.save_for_backward(x2, weight)
        else:
            ctx.save_for_backward(x_q, sx, w_q, sw)
        ctx.cfg, ctx.scales, ctx.history, ctx.observers = cfg, scales, history, observers
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # autocast off here too: eager backward runs outside the user's autocast block, but a compiled
        # backward is traced under the forward's autocast state, which would lower the fp32 GEMMs to bf16
        with torch.autocast(grad.device.type, enabled=False):
            return _Fp8LinearFn._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        cfg: Fp8Config = ctx.cfg
        fx, fw, fg = cfg.formats
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.history is not None:  # delayed scaling: this step's grad_output amax
            record_(ctx.history, 2, amax_fmax(g2))  # (NaN skipped, as TE's fmaxf)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        observers = ctx.observers
        if cfg.rowwise:  # each gradient GEMM scales its operands along its own reduction axis
            x2, weight = ctx.saved_tensors
            if need_x:
                sg, sw = cfg.scale(g2, 2, -1, None), cfg.scale(weight, 1, 0, None)
                g_q, w_q = quantize(g2, sg, fg), quantize(weight, sw, fw).contiguous()
                for obs in observers:
                    obs.cast(2, g2, g_q, sg, fg)
                grad_x = gemm.grad_input(g_q, sg, w_q, sw, ctx.x_dtype, cfg.backend)
            if need_w:
                sg, sx = cfg.scale(g2, 2, 0, None), cfg.scale(x2, 0, 0, None)
                g_q, x_q = quantize(g2, sg, fg), quantize(x2, sx, fx)
                grad_w = gemm.grad_weight(g_q, sg, x_q, sx, cfg.backend)
        else:
            x_q, sx, w_q, sw = ctx.saved_tensors
            sg = cfg.scale(g2, 2, None, ctx.scales)
            g_q = quantize(g2, sg, fg)
            for obs in observers:
                obs.cast(2, g2, g_q, sg, fg)
            if need_x:
                grad_x = gemm.grad_input(g_q, sg, w_q, sw, ctx.x_dtype, cfg.backend)
            if need_w:
                grad_w = gemm.grad_weight(g_q, sg, x_q, sx, cfg.backend)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        return grad_x, grad_w, None, None, None, None, None, None


class Fp8Matmul:
    """What every fp8 layer shares (a mixin before the layer's own class): ``x @ W.T + b`` from fp8
    operands, ``W`` given as ``(out, in)`` by ``fp8_weight()``.

    Attributes: ``fp8_config`` (``Fp8Config``), ``fp8_name`` (its qualified name in the model),
    ``fp8_observers`` (diagnostics observers, a tuple: empty when nothing watches), and for delayed
    scaling the buffers ``fp8_amax_history`` (L x 3) and ``fp8_scale`` (3: input, weight, grad_output).
    """

    fp8_config: Fp8Config
    fp8_name: str = ""
    fp8_observers: tuple = ()
    fp8_original_class: type = nn.Linear
    weight: nn.Parameter
    bias: nn.Parameter | None
    training: bool

    def fp8_weight(self) -> torch.Tensor:
        """The weight as ``(out_features, in_features)``."""
        return self.weight

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle casts its weight anew
        base = getattr(super(), "__getstate__", None)  # (object has one from Python 3.11)
        state = dict(base() if base is not None else self.__dict__)
        state.pop(WEIGHT_CACHE, None)
        return state

    def _check_input(self, x: torch.Tensor) -> None:
        """What ``nn.Linear`` refuses, refused here too with the layer's name: the casts would compute an
        integer input (``x.float() * s``) and return integers, and MXFP8 named only its 32-blocks."""
        name = f"fp8 layer {self.fp8_name or type(self).__name__!r}"
        if not (x.is_floating_point() and x.dtype.itemsize >= 2):
            raise TypeError(f"{name}: the input is {x.dtype}; an fp8 matmul takes a floating-point input (fp32, "
                            "bf16 or fp16, as nn.Linear does): cast it first (an embedding for token ids)")
        n_in = self.in_features  # type: ignore[attr-defined]
        if x.dim() == 0 or x.shape[-1] != n_in:
            got = f"{x.shape[-1]} features in its last dimension" if x.dim() else "no dimension (a 0-d tensor)"
            raise ValueError(f"{name}: the input has {got} (shape {tuple(x.shape)}); the layer takes {n_in} features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # compute from the autocast dtype, as F.linear would
            x = x.to(torch.get_autocast_dtype(device))
        cfg = self.fp8_config
        weight = self.fp8_weight()
        scales = self.fp8_scale if cfg.scaling == "delayed" else None
        with torch.autocast(device, enabled=False):
            if cfg.mx:  # block scaling: its own GEMMs (mixprec.fp8.mx)
                from mixprec.fp8.mx import MxLinearFn

                out = MxLinearFn.apply(x, weight, cfg, self.fp8_observers)
            else:
                w_q, sw, w_amax = cast_weight(self, weight, cfg, scales)  # (cached within a window)
                history = None
                if scales is not None and self.training and torch.is_grad_enabled():  # eval leaves the history alone
                    history = self.fp8_amax_history
                    record_(history, slice(0, 2), torch.stack((amax_fmax(x), w_amax)))
                out = _Fp8LinearFn.apply(x, weight, w_q, sw, scales, history, cfg, self.fp8_observers)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def fp8_repr(self) -> str:
        c = self.fp8_config
        fmts = "/".join(f.name for f in c.formats)
        return f"fp8={c.scaling}{' rowwise' if c.rowwise else ' mx' if c.mx else ''} {fmts} ({c.backend})"


class Fp8Linear(Fp8Matmul, nn.Linear):
    """An ``nn.Linear`` computing in fp8 (made by ``mixprec.fp8.swap``, not constructed directly)."""

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self.fp8_repr()}"
