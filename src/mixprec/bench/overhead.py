"""What ``MixedPrecision.step`` costs against the same step written by hand with torch.amp.

Three arms train identical copies of the reference block (same seed, optimizer, batches, clipping):

- ``mixprec``: ``with mp.autocast(): ...``; ``mp.step(loss, opt, max_grad_norm=clip)``.
- ``hand``: the same prepared model (so the forward, fp32 norm islands included, is the same
  work) and the seeds' loop: ``opt.zero_grad(set_to_none=True)``; ``scaler.scale(loss).backward()``;
  ``scaler.unscale_(opt)``; ``clip_grad_norm_``; ``scaler.step(opt)``; ``scaler.update()``, with a
  ``torch.amp.GradScaler`` that is disabled for recipes without loss scaling (nanoGPT's idiom).
- ``hand-plain`` (optional): the hand loop on an unprepared model, i.e. what a user has before
  mixprec; the difference to ``hand`` is the price of the fp32 islands and the output cast.

mixprec / hand is the step's overhead. Both arms compute the same numbers: the run ends by
checking that their parameters are bitwise equal, so the comparison is of like with like.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.bench.block import RefBlock, Shape, loss_fn, make_batches
from mixprec.bench.runner import Log, default_optimizer, make_optimizer
from mixprec.instruments.machine import environment
from mixprec.instruments.timing import Summary, interleaved_order, paired_ratio, synchronize
from mixprec.recipes import resolve_recipe
from mixprec.training import MixedPrecision

ARMS = ("mixprec", "hand", "hand-plain")


class Arm:
    """One way of writing the training step; ``iteration()`` returns (iteration s, step s)."""

    def __init__(self, kind: str, recipe: str, shape: Shape, device: torch.device, optimizer: str,
                 clip: float | None, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if kind not in ARMS:
            raise ValueError(f"unknown arm {kind!r}; expected one of {', '.join(ARMS)}")
        self.kind, self.device, self.clip, self.batches = kind, device, clip, batches
        self.mp = MixedPrecision(recipe, device)
        torch.manual_seed(0)
        model = RefBlock(shape).to(device)
        self.model: nn.Module = model if kind == "hand-plain" else self.mp.prepare(model)
        self.opt = make_optimizer(self.model.parameters(), optimizer)
        r = self.mp.recipe
        self.scaler = torch.amp.GradScaler(device.type, enabled=r.loss_scaling == "dynamic")
        self._autocast: Callable[[], Any] = (
            self.mp.autocast if kind == "mixprec"
            else lambda: torch.autocast(device.type, dtype=r.policy.compute_dtype, enabled=r.autocast)
        )
        self.i = 0

    def _mixprec_step(self, loss: torch.Tensor) -> None:
        self.mp.step(loss, self.opt, max_grad_norm=self.clip)

    def _hand_step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)  # before clipping
        if self.clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()

    def loss(self) -> torch.Tensor:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with self._autocast():
            out = self.model(x)
        return loss_fn(out, y)

    def step(self, loss: torch.Tensor) -> None:
        (self._mixprec_step if self.kind == "mixprec" else self._hand_step)(loss)

    def iteration(self) -> tuple[float, float]:
        """One forward + step. The step's own time is exact on CPU; on CUDA it is host time only
        (no sync in between, which would change what is measured), so read the iteration there."""
        t0 = time.perf_counter()
        loss = self.loss()
        t1 = time.perf_counter()
        self.step(loss)
        synchronize(self.device)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_ops(arm: Arm) -> collections.Counter[str]:
    """The aten ops one step of ``arm`` dispatches (backward and optimizer included), by name.

    A count, unlike a time, is exact on a busy machine: the difference between two arms is
    precisely the work one adds per step.
    """
    loss = arm.loss()
    with _OpCounter() as counter:
        arm.step(loss)
    return counter.counts


def op_difference(a: collections.Counter[str], b: collections.Counter[str]) -> dict[str, int]:
    """Ops whose count differs: ``{name: count in a - count in b}``."""
    return {k: a[k] - b[k] for k in sorted(set(a) | set(b)) if a[k] != b[k]}


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run_overhead(
    shape: Shape,
    device: torch.device,
    recipe: str,
    *,
    rounds: int = 50,
    warmup: int = 3,
    optimizer: str | None = None,
    clip: float | None = 1.0,
    arms: Sequence[str] = ("mixprec", "hand"),
    log: Log | None = None,
) -> dict[str, Any]:
    """Interleave the arms for ``rounds`` rounds and return timings and paired ratios (JSON-ready)."""
    say = log or (lambda msg: None)
    optimizer = optimizer or default_optimizer(device)
    name = resolve_recipe(recipe, device).name
    if "mixprec" not in arms or "hand" not in arms:
        raise ValueError(f"arms must include 'mixprec' and 'hand', got {list(arms)}")
    batches = make_batches(shape, device, count=4)
    built = {k: Arm(k, name, shape, device, optimizer, clip, batches) for k in arms}
    say(f"{name}: warming up {', '.join(arms)}")
    for _ in range(warmup):
        for arm in built.values():
            arm.iteration()
    ops = {k: step_ops(built[k]) for k in ("mixprec", "hand")}
    it: dict[str, list[float]] = {k: [] for k in arms}
    st: dict[str, list[float]] = {k: [] for k in arms}
    for r, k in interleaved_order(list(arms), rounds):
        t_it, t_st = built[k].iteration()
        it[k].append(t_it)
        st[k].append(t_st)
        if k == arms[-1] and (r + 1) % 10 == 0:
            say(f"{name}: round {r + 1}/{rounds}")
    synchronize(device)
    out: dict[str, Any] = {
        "recipe": name,
        "arms": {k: {"iteration_s": Summary.of(it[k]).to_dict(), "step_s": Summary.of(st[k]).to_dict()} for k in arms},
        # the headline: per-round ratio of whole iterations, and of the step alone
        "ratio_iteration": paired_ratio(it["mixprec"], it["hand"]),
        "ratio_step": paired_ratio(st["mixprec"], st["hand"]),
        "extra_us_per_step": 1e6 * Summary.of([a - b for a, b in zip(st["mixprec"], st["hand"])]).median,
        "extra_ops_per_step": op_difference(ops["mixprec"], ops["hand"]),
        "ops_per_step": {k: sum(c.values()) for k, c in ops.items()},
        "max_param_diff_vs_hand": _max_param_diff(built["mixprec"].model, built["hand"].model),
        "samples": {k: {"iteration_s": it[k], "step_s": st[k]} for k in arms},
    }
    if "hand-plain" in arms:
        out["ratio_iteration_vs_plain"] = paired_ratio(it["mixprec"], it["hand-plain"])
    return out


def run_overhead_suite(
    shape: Shape,
    device: torch.device,
    recipes: Sequence[str],
    optimizers: Sequence[str],
    **kwargs: Any,
) -> dict[str, Any]:
    """``run_overhead`` for each (recipe, optimizer) pair, in one JSON document."""
    runs = []
    for opt in optimizers:
        for recipe in recipes:
            try:
                runs.append({"optimizer": f"AdamW({opt})", "status": "ok",
                             **run_overhead(shape, device, recipe, optimizer=opt, **kwargs)})
            except Exception as e:  # keep the other pairs
                runs.append({"optimizer": f"AdamW({opt})", "recipe": recipe, "status": "error",
                             "error": f"{type(e).__name__}: {e}"})
    return {
        "kind": "mixprec-overhead",
        "version": 1,
        "env": environment(device),
        "shape": dataclasses.asdict(shape),
        "settings": {k: v for k, v in kwargs.items() if k != "log"},
        "runs": runs,
    }
