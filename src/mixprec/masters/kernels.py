"""The compact strategies' update kernels: the arithmetic of ``rounding`` as one fused pass per bucket.

Written with eager tensor ops, a Kahan write-back is ~15 passes over a bucket (conversions, the
compensated sum, masks), a remainder split or join ~10 integer passes, stochastic rounding its
random bits and a mask: 20-50 ns per parameter on a CPU, against ~5 for bf16-true's plain cast.
Each kernel here is a pure function of flat tensors, and ``torch.compile`` fuses it into one loop.

Bitwise the same as the eager arithmetic (tests/masters/test_masters_kernels.py: every bf16
pattern, specials, both storage dtypes): the kernels use only exact operations (conversions,
IEEE additions, integer ops, selects), and ``emulate_precision_casts`` makes inductor round every
intermediate to its dtype (by default it may keep a value in fp32 across a bf16 round trip, which
changes a Kahan compensation). Random bits are a hash of the element's index
(``rounding.random_bits16``), computed inside the kernel from a key drawn eagerly from the
strategy's generator: the same bits compiled or not, on any device.

When: ``KernelSet.mode`` is "auto" (compiled once the strategy holds ``AUTO_NUMEL`` 16-bit
elements or more: below that the eager step costs a few ms and a first compile of ~10-30 s is
rarely repaid), "compiled" or "eager"; the environment variable ``MIXPREC_MASTER_KERNELS`` sets it.
If compiling fails in "auto" (no C++ compiler, an unsupported backend) the eager kernels run, with
one warning; in "compiled" the error is raised. ``describe()`` says which ran.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec._env import env_choice
from mixprec.masters.rounding import join_fp32, random_bits16, random_bits16_at, round_bf16_with_bits, split_fp32

MODES = ("auto", "compiled", "eager")
ENV = "MIXPREC_MASTER_KERNELS"
AUTO_NUMEL = 1 << 18


def kahan_update(param_16: torch.Tensor, comp_16: torch.Tensor, stepped_32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Kahan write-back, pure: the new (param, compensation) for a stepped fp32 value.

    Bit for bit ``kahan_add_(p, c, p.float().neg_().add_(stepped))``: the update is -p + stepped,
    the rest is ``rounding.kahan_add_``'s arithmetic (see there for why it is exact)."""
    p_32 = param_16.float()
    update_32 = -p_32 + stepped_32
    y_32 = -comp_16.float() + update_32
    t_16 = (p_32 + y_32).to(param_16.dtype)
    c_16 = ((t_16.float() - p_32) - y_32).to(comp_16.dtype)
    moved = update_32 != 0  # (x.bool() in kahan_add_: the same test, NaN included)
    return torch.where(moved, t_16, param_16), torch.where(moved, c_16, comp_16)


def kahan_write(param_16: torch.Tensor, comp_16: torch.Tensor, stepped_32: torch.Tensor) -> torch.Tensor:
    """``kahan_update`` storing the new parameters into ``param_16`` and the compensation into
    ``comp_16`` (a compiled kernel writes both in its one pass, allocating nothing); returns
    ``param_16``. (``kahan_add_``, the eager form, also updates both in place.)"""
    p_16, c_16 = kahan_update(param_16, comp_16, stepped_32)
    comp_16.copy_(c_16)
    param_16.copy_(p_16)
    return param_16


def split_write(x_32: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """``split_fp32`` storing the remainder into ``rem``; returns the bf16 half."""
    high_16, rem_16 = split_fp32(x_32)
    rem.copy_(rem_16)
    return high_16


def sr_round(stepped_32: torch.Tensor, key: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding to bf16 with the random bits of ``key`` (``rounding.draw_key``) for the
    stream elements from ``start`` (a 0-dim int64 tensor: a number would be compiled in)."""
    index = torch.arange(stepped_32.numel(), dtype=torch.int64, device=stepped_32.device) + start
    return round_bf16_with_bits(stepped_32, random_bits16_at(index, key))


def sr_round_eager(stepped_32: torch.Tensor, key: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``sr_round`` in eager ops, the random bits made two per hash (``rounding.random_bits16``)."""
    return round_bf16_with_bits(stepped_32, random_bits16(stepped_32.numel(), key, int(start)))


KERNELS: dict[str, Callable[..., Any]] = {"kahan": kahan_write, "sr": sr_round, "split": split_write, "join": join_fp32}
EAGER: dict[str, Callable[..., Any]] = {**KERNELS, "sr": sr_round_eager}


def _mode_from_env() -> str:
    return env_choice(ENV, MODES, "'auto' compiles the compact master strategies' update kernels for models large "
                      "enough to repay it, 'compiled' always, 'eager' never")


class KernelSet:
    """The update kernels of one strategy instance: eager or compiled, and what happened."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = _mode_from_env() if mode is None else mode
        if self.mode not in MODES:
            raise ValueError(f"master kernels mode {self.mode!r} is not one of {', '.join(MODES)}")
        self.compile = self.mode == "compiled"
        self.failed: str | None = None  # why compiling failed (auto mode: the eager kernels ran)
        self.ran: set[str] = set()  # "compiled" / "eager", as they were used
        self._fns: dict[tuple[str, str], Callable[..., Any]] = {}

    def size_to(self, numel: int) -> None:
        """In "auto", compile for a strategy holding ``numel`` 16-bit elements if it is large enough."""
        if self.mode == "auto":
            self.compile = numel >= AUTO_NUMEL

    def __call__(self, name: str, *args: torch.Tensor) -> Any:
        if self.compile and self.failed is None:
            try:
                out = self._compiled(name, args[0].device.type)(*args)
            except Exception as e:  # noqa: BLE001 - any backend failure: the eager kernel computes the same
                if self.mode == "compiled":
                    raise RuntimeError(f"compiling the master-weight update kernel {name!r} failed ({type(e).__name__}: "
                                       f"{e}); set {ENV}=eager (or auto) to run the eager kernels, which compute "
                                       "the same bits, slower") from e
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                warnings.warn(f"mixprec: torch.compile of the master-weight update kernels failed ({self.failed}); "
                              f"running the eager kernels (the same results, slower). Set {ENV}=eager to skip the attempt.",
                              RuntimeWarning, stacklevel=3)
            else:
                self.ran.add("compiled")
                return out
        self.ran.add("eager")
        return EAGER[name](*args)

    def _compiled(self, name: str, device_type: str) -> Callable[..., Any]:
        fn = self._fns.get((name, device_type))
        if fn is None:
            fn = self._fns[(name, device_type)] = torch.compile(
                KERNELS[name], dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
        return fn

    def describe(self) -> str:
        if self.failed:
            return f"eager (torch.compile failed: {self.failed})"
        if self.ran:
            return " and ".join(sorted(self.ran))
        return "compiled (torch.compile)" if self.compile else "eager"
