"""What every framework integration needs: the version check, optimizers moved onto the fp32
masters, lr schedulers that do not advance on a skipped step, and mixprec's own checkpoint file
written atomically and read back without unpickling code."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec._files import write_aside
from mixprec.training import MixedPrecision


def _release(version: str) -> tuple[int, ...]:
    """``"2.6.6"`` -> (2, 6, 6); ``"5.0.0.dev0"`` and ``"2.7.0rc1"`` -> their release numbers."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"cannot read a version number from {version!r}")
    return tuple(int(x) for x in match.group(0).split("."))


def installed_version(package: str) -> str:
    """The ``__version__`` of the imported ``package`` (as imported now: lazy packages such as
    transformers replace their module object in ``sys.modules`` while importing)."""
    __import__(package)
    return str(sys.modules[package].__version__)


def check_version(package: str, minimum: str, below: str, extra: str, check: bool = True) -> None:
    """Raise when the imported ``package`` is outside the tested range [minimum, below).

    The integrations use public extension points, but those move between major (and, for
    Lightning, minor) releases: an untested version is refused with what to do, unless the
    caller passes ``check_version=False``.
    """
    if not check:
        return
    installed = installed_version(package)
    have = _release(installed)
    if _release(minimum) <= have < _release(below):
        return
    raise RuntimeError(
        f"{package} {installed} is installed; mixprec's {package} integration is tested with "
        f"{package}>={minimum},<{below}. Install a tested version (pip install \"mixprec[{extra}]\" "
        f"pins one), or pass check_version=False to try this one anyway."
    )


def rebind_to_masters(mp: MixedPrecision, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """For a 16-bit storage recipe: replace, in place, the 16-bit model parameters that a
    framework's optimizer was built over (``model.parameters()``, before or after ``prepare``)
    by their fp32 masters, so that it steps the masters and keeps its state in fp32.

    Raises ValueError when an optimizer already holds state for a 16-bit parameter (it has
    stepped it: that state would be lost).
    """
    if mp.masters is None:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            params = list(group["params"])
            view = mp.masters.optimizer_view(params)
            moved = [p for p, q in zip(params, view) if p is not q]
            stateful = [p for p in moved if opt.state.get(p)]
            if stateful:
                raise ValueError(
                    f"the {type(opt).__name__} holds optimizer state for {len(stateful)} parameters that "
                    f"recipe {mp.recipe.name!r} stores in 16 bits: it has stepped them already, and moving "
                    "it onto the fp32 masters would lose that state. Build the optimizer fresh, before "
                    "its first step (Lightning: in configure_optimizers; Trainer: create_optimizer)."
                )
            group["params"] = view
    mp.masters.check_optimizers(list(optimizers))


class SkipAwareScheduler:
    """An lr scheduler whose ``step()`` does nothing after an optimizer step that the loss scaler
    skipped, as ``mp.step(scheduler=...)`` does: a skipped step does not advance the schedule.

    Everything else (``get_last_lr``, ``optimizer``, ``state_dict``...) is the wrapped scheduler's.
    Deciding costs no extra host sync after an unfused step (the scaler knows it on the host).

    ``hold=False`` (a scheduler whose cadence is not known: Lightning's manual optimization with
    ``"interval": "epoch"``) steps it anyway and calls ``note()`` instead, which says so.

    Attributes: ``scheduler`` (the wrapped one), ``held`` (how many steps were held back).
    """

    def __init__(self, scheduler: Any, mp: MixedPrecision, *, hold: bool = True,
                 note: Callable[[], None] | None = None) -> None:
        if isinstance(scheduler, SkipAwareScheduler):
            scheduler = scheduler.scheduler
        self.__dict__["scheduler"] = scheduler
        self.__dict__["mp"] = mp
        self.__dict__["held"] = 0
        self.__dict__["_hold"] = hold
        self.__dict__["_note"] = note

    def step(self, *args: Any, **kwargs: Any) -> Any:
        scaler = self.mp.scaler
        if scaler.is_enabled() and scaler.was_skipped():
            if self.__dict__["_hold"]:
                self.__dict__["held"] += 1
                return None
            if self.__dict__["_note"] is not None:
                self.__dict__["_note"]()
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` written aside, flushed, then renamed over ``path`` (``mixprec._files``): a
    crash, a full disk or a Ctrl-C mid-write leaves the old file (or none), never a torn one that a resume
    would trip over."""
    write_aside(path, lambda f: torch.save(obj, f))


def load_state_file(path: str, device: Any, what: str) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain data only, never code (a crafted file
    cannot run anything). A file that cannot be read so is refused naming it, as damaged, with what to do."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # (torch/pickle raise RuntimeError, UnpicklingError, EOFError... for a damaged file)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        why = ("it holds more than tensors and plain data, which mixprec never unpickles"
               if "Weights only load failed" in str(e) else f"{type(e).__name__}: {first}")
        raise RuntimeError(
            f"{path} is damaged and cannot be loaded ({why}); {what}. Resume from an earlier checkpoint, or "
            "delete this checkpoint directory and resume from the one before it."
        ) from None
