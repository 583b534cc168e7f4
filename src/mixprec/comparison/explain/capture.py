"""Where the error enters: the recipe's run measured against fp32, module by module.

``capture`` trains the recipe from the comparison's seed on the comparison's batches (the same
run that diverged) and, at a few of its steps, runs the fp32 model on the same weights (the
recipe's fp32 values: its masters where it stores 16 bits) and the same batch beside it. For each
module it measures, against fp32:

- ``fwd``: the relative error of its output (what it received plus what it added), and ``fwd_in``
  of its input; ``grad``: of the gradient that came back to its output (unscaled);
- ``added`` and ``grad_added``: the error the module adds on its own: it is run again, alone,
  under the recipe on fp32's input and fp32's output gradient (``sidebyside.replay``);
- ``flushed``: the share of gradient entries, non-zero in fp32, that are zero in the recipe
  (fp16 underflow at the step's loss scale);
- for 16-bit storage recipes, ``kept``: the share of the optimizer's update its stored weights
  kept (updates lost to rounding show as ``kept`` near 0);

and, once, the dtype of the output and the loss, and the reductions that ran on 16-bit inputs
(``mixprec.instruments.reductions``). The capture run reproduces the comparison's run (the
training steps are the same, the measuring is beside them); ``reproduced`` says whether its
losses came out the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec.comparison.explain.sidebyside import (
    Call, Recorder, _same_randomness, _rng_state, floats, flushed, nonfinite, param_grads, rel_error, replay,
)
from mixprec.comparison.runner import _build_model, _call_get_batch
from mixprec.formats import get_format, short_name
from mixprec.instruments.reductions import Reduction, ReductionTrace
from mixprec.islands import island_names
from mixprec.recipes import Recipe
from mixprec.tasks import Task, to_device
from mixprec.training import MixedPrecision

ROOT = "(the model)"  # how the model itself (module name "") is shown


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one value to nearest in this format."""
    return get_format(dtype).eps / 2


@dataclasses.dataclass
class ModuleError:
    """One module's error against fp32, the worst over its calls and the captured steps (see the
    module doc for each measure; None: not measured, with the reason in ``unmeasured``)."""

    name: str
    type: str
    order: int
    parent: str | None
    calls: int
    out_dtype: str
    island: bool
    fwd: float = 0.0
    fwd_in: float = 0.0
    grad: float | None = None
    added: float | None = None
    grad_added: float | None = None
    flushed: float | None = None
    kept: float | None = None
    nonfinite: bool = False
    made_nonfinite: bool = False
    unchanged: bool = True
    unmeasured: str | None = None
    received_overflow: bool = False  # what it received had already overflowed its dtype (the module before did)
    nonfinite_op: str | None = None  # the first op in it that made a non-finite value from finite inputs

    @property
    def label(self) -> str:
        return self.name or ROOT

    @property
    def grad_overflow(self) -> bool:
        """Its backward, fed fp32's output gradient times the step's loss scale, made a non-finite
        gradient: the scale is too large for it (the scaler skips such steps and lowers the scale)."""
        return self.grad_added is not None and math.isinf(self.grad_added)

    @property
    def score(self) -> float:
        """What it adds by itself (forward or backward): the ranking key. inf when its forward made
        a non-finite value from finite input; its output's error when the replay could not run. A
        backward that overflowed at the loss scale is not counted here (the scaler skips that step
        and lowers the scale: it is evidence about the scale, ``grad_overflow``)."""
        if self.made_nonfinite:
            return math.inf
        own = [v for v in (self.added, self.grad_added) if v is not None and v == v and not math.isinf(v)]
        if own:
            return max(own)
        return 0.0 if self.received_overflow else self.fwd

@dataclasses.dataclass
class Capture:
    """What ``capture`` measured. ``modules`` are in the order of their first call."""

    recipe: str
    compute: str  # the 16-bit format the recipe computes in (short name), or f32
    unit_roundoff: float
    steps: list[int]  # captured steps, numbered from 1
    modules: list[ModuleError]
    output_dtype: str
    loss_dtype: str
    reductions: list[Reduction]
    scales: list[float]
    grad_max: float  # largest |gradient| fp32 computed (module outputs and parameters)
    fit_scale: float  # the largest power-of-two loss scale that keeps grad_max x scale under half of fp16's max
    flushed: float | None  # over every gradient entry compared
    losses: list[float]
    reproduced: bool | None
    notes: list[str]
    wall_s: float
    param_names: list[str] = dataclasses.field(default_factory=list)
    loss_error: float = 0.0  # the recipe's loss against fp32's, the worst captured step
    loss_made_nonfinite: bool = False  # non-finite loss from finite model outputs: the loss itself overflowed

    def module(self, name: str) -> ModuleError:
        return next(m for m in self.modules if m.name == name)

    def children(self, name: str) -> list[ModuleError]:
        return [m for m in self.modules if m.parent == name]

    def ranked(self) -> list[ModuleError]:
        """Every module that is not an island already, worst first by what it adds."""
        return sorted((m for m in self.modules if not m.island and m.score == m.score),
                      key=lambda m: (-m.score, m.order))

    def entry_points(self, factor: float = 16.0) -> list[ModuleError]:
        """Modules that add more than ``factor`` unit roundoffs by themselves while none of the
        modules they call accounts for it (a child adding at least a quarter as much): where the
        error is made, worst first."""
        out = []
        for m in self.modules:
            if m.island or not m.score >= factor * self.unit_roundoff:
                continue
            if any(c.score >= m.score / 4 for c in self.children(m.name)):
                continue
            out.append(m)
        return sorted(out, key=lambda m: (-m.score, m.order))

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "compute": self.compute, "unit_roundoff": self.unit_roundoff, "steps": self.steps,
            "output_dtype": self.output_dtype, "loss_dtype": self.loss_dtype, "scales": self.scales,
            "grad_max": _num(self.grad_max), "fit_scale": self.fit_scale, "flushed": self.flushed,
            "loss_error": _num(self.loss_error), "loss_made_nonfinite": self.loss_made_nonfinite,
            "reproduced": self.reproduced, "notes": self.notes, "wall_s": self.wall_s,
            "reductions_16bit": [r.to_dict() for r in self.reductions],
            "entry_points": [m.label for m in self.entry_points()],
            "modules": [{k: _num(v) for k, v in dataclasses.asdict(m).items()} for m in self.modules],
        }


def _num(v: Any) -> Any:
    """JSON has no inf or NaN: they become strings a reader can still tell apart."""
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else "-inf" if v < 0 else "nan"
    return v


class _UpdateWatch:
    """The optimizer's own update of each parameter in one step (fp32, before any 16-bit storage
    rounds it): step pre/post hooks snapshot what the optimizer sees (per bucket when a 16-bit
    recipe steps a bucket at a time)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}
        self.handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    def _visible(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in self._visible(opt):
            self.before[id(p)] = p.detach().float().clone()

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in self._visible(opt):
            b = self.before.pop(id(p), None)
            if b is not None:
                d = p.detach().float() - b
                self.delta[id(p)] = d if id(p) not in self.delta else self.delta[id(p)] + d

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _kept(watch: _UpdateWatch, names: dict[int, str], before: dict[str, torch.Tensor],
          after: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """param name -> (<realised, intended>, <intended, intended>): the update the stored value kept."""
    out = {}
    for pid, delta in watch.delta.items():
        name = names.get(pid)
        if name is None or name not in before or name not in after:
            continue
        realised = (after[name].double() - before[name].double()).flatten()
        intended = delta.double().flatten()
        out[name] = (float(realised @ intended), float(intended @ intended))
    return out


def capture(task: Task, recipe: Recipe, device: torch.device, at_steps: Sequence[int], *,
            mp_options: dict[str, Any] | None = None, seed: int = 0,
            expected_loss: np.ndarray | None = None, say: Callable[[str], None] | None = None) -> Capture:
    """Train ``recipe`` up to the last of ``at_steps`` (0-based) and measure at each (module doc)."""
    t0 = time.perf_counter()
    say = say or (lambda _m: None)
    mp = MixedPrecision(recipe, device, **(mp_options or {}))
    dev = mp.device
    model_r = mp.prepare(_build_model(task, seed, dev))
    opt = task.build_optimizer(mp.parameters(model_r))
    model_32 = _build_model(task, seed, dev)  # its weights are the recipe's at every captured step
    rec32, rec_r = Recorder(model_32, keep_args=True), Recorder(model_r, keep_args=False)
    islands = set(island_names(model_r))
    proxies = {id(p): n for n, p in mp.named_parameters(model_r)}
    notes: list[str] = []
    replays_ok = recipe.fp8 is None
    if not replays_ok:
        notes.append("fp8 layers keep scaling state that a replayed forward would advance: the error each module "
                     "adds alone was not measured (its output's error was)")
    acc = _Accumulator()
    losses: list[float] = []
    scales: list[float] = []
    first = {"out": "-", "loss": "-"}
    reductions: list[Reduction] = []
    captured: list[int] = []
    loss_err, made_loss = 0.0, False
    steps = sorted(set(int(s) for s in at_steps))
    try:
        for step in range(steps[-1] + 1):
            inputs, targets = to_device(_call_get_batch(task, step), dev)
            if step not in steps:
                with mp.autocast():
                    out = task.run_forward(model_r, inputs)
                stats = mp.step(task.loss_fn(out, targets), opt, max_grad_norm=task.max_grad_norm)
                losses.append(float(stats.loss))
                continue
            state = mp.fp32_state_dict(model_r)
            if not all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()):
                notes.append(f"the recipe's weights are non-finite before step {step + 1}: nothing measured from there")
                break
            say(f"measuring every module at step {step + 1} (fp32 and {recipe.name} side by side)")
            model_32.load_state_dict(state)
            model_32.zero_grad(set_to_none=True)
            rng = _rng_state()
            rec32.reset(), rec_r.reset()
            rec32.active = True
            try:
                with _same_randomness(rng):
                    loss32 = task.loss_fn(task.run_forward(model_32, inputs), targets)
                loss32.backward()
            finally:
                rec32.active = False
            g32 = param_grads(model_32)
            scale = float(mp.scaler.scale(torch.ones((), device=dev)))
            trace = ReductionTrace(model_r) if not captured else contextlib.nullcontext()
            rec_r.active = True
            try:
                with trace:
                    with mp.autocast():
                        out_r = task.run_forward(model_r, inputs)
                    loss_r = task.loss_fn(out_r, targets)
            finally:
                rec_r.active = False
            if isinstance(loss_r, torch.Tensor) and loss_r.numel() == 1:
                loss_err = max(loss_err, rel_error([loss_r.detach().reshape(1)], [loss32.detach().reshape(1)]))
                made_loss |= (not bool(torch.isfinite(loss_r).all()) and not nonfinite(floats(out_r))
                              and bool(torch.isfinite(loss32).all()))
            if not captured:
                reductions = trace.records  # type: ignore[union-attr]
                outs = floats(out_r)
                first = {"out": short_name(outs[0].dtype) if outs else "-",
                         "loss": short_name(loss_r.dtype) if isinstance(loss_r, torch.Tensor) else "-"}
            replays = _replay_all(rec32, rec_r, model_32, model_r, mp, scale) if replays_ok else {}
            g_r: dict[str, torch.Tensor] = {}
            hooks = [p.register_hook(_store(g_r, n)) for n, p in model_r.named_parameters() if p.requires_grad]
            watch = _UpdateWatch(opt) if recipe.stores_16bit else None
            try:
                stats = mp.step(loss_r, opt, max_grad_norm=task.max_grad_norm)
            finally:
                for h in hooks:
                    h.remove()
                if watch is not None:
                    watch.remove()
            kept = _kept(watch, proxies, state, mp.fp32_state_dict(model_r)) if watch is not None else {}
            acc.add(model_32, rec32, rec_r, replays, g32, g_r, scale, kept)
            losses.append(float(stats.loss))
            scales.append(scale)
            captured.append(step + 1)
    finally:
        rec32.remove()
        rec_r.remove()
    reproduced = None
    if expected_loss is not None and len(losses):
        n = min(len(losses), len(expected_loss))
        reproduced = bool(np.array_equal(np.asarray(losses[:n]), np.asarray(expected_loss[:n]), equal_nan=True))
        if not reproduced:
            notes.append("the capture run's losses differ from the comparison's run of the same recipe (non-deterministic "
                         "kernels?): the errors are those of a run like it, not of that run")
    compute = recipe.compute_dtype
    modules = acc.modules(islands)
    grad_max = acc.grad_max
    f16 = get_format(torch.float16)
    fit = 2.0 ** min(24, max(0, math.floor(math.log2(f16.max / (2 * grad_max))))) if grad_max > 0 else 2.0**16
    return Capture(recipe.name, short_name(compute), unit_roundoff(compute), captured, modules, first["out"],
                   first["loss"], reductions, scales, grad_max, fit, acc.flushed_share, losses, reproduced, notes,
                   time.perf_counter() - t0, [n for n, _ in model_32.named_parameters()], loss_err, made_loss)


def _store(into: dict[str, torch.Tensor], name: str) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        into[name] = grad.detach().clone() if name not in into else into[name] + grad.detach()
    return hook


def _replay_all(rec32: Recorder, rec_r: Recorder, m32: nn.Module, m_r: nn.Module, mp: MixedPrecision,
                scale: float) -> dict[tuple[str, int], Any]:
    """Every recorded fp32 call replayed on both models (``sidebyside.replay``); a call that cannot
    be replayed gets the exception's text."""
    by_r = rec_r.by_key()
    out: dict[tuple[str, int], Any] = {}
    for call in rec32.calls:
        other = by_r.get((call.name, call.index))
        dtypes = other.in_dtypes if other is not None and len(other.in_dtypes) == len(call.inputs) else call.in_dtypes
        try:
            out[(call.name, call.index)] = replay(call, dtypes, m32.get_submodule(call.name),
                                                  m_r.get_submodule(call.name), mp.autocast, scale)
        except Exception as e:  # a module whose call cannot be repeated (state, caches): say so, measure the rest
            out[(call.name, call.index)] = f"{type(e).__name__}: {e}"
    return out


class _Accumulator:
    """Gathers per-call measures into one ``ModuleError`` per module (the worst over calls and steps)."""

    def __init__(self) -> None:
        self.rows: dict[str, ModuleError] = {}
        self.zeroed = self.nonzero = 0
        self.grad_max = 0.0
        self._kept: dict[str, list[float]] = {}

    def add(self, m32: nn.Module, rec32: Recorder, rec_r: Recorder, replays: dict, g32: dict[str, torch.Tensor],
            g_r: dict[str, torch.Tensor], scale: float, kept: dict[str, tuple[float, float]]) -> None:
        by_r = rec_r.by_key()
        for t in [*g32.values(), *(g for c in rec32.calls for g in c.grads.values())]:
            self.grad_max = max(self.grad_max, float(t.detach().abs().max()) if t.numel() else 0.0)
        for call in rec32.calls:
            row = self._row(m32, call)
            other = by_r.get((call.name, call.index))
            if other is None:
                row.unmeasured = "not called in the recipe's forward"
                continue
            row.out_dtype = short_name(other.outputs[0].dtype) if other.outputs else "-"
            row.fwd = _worst(row.fwd, rel_error(other.outputs, call.outputs))
            row.fwd_in = _worst(row.fwd_in, rel_error(other.inputs, call.inputs))
            row.nonfinite |= nonfinite(other.outputs)
            common = sorted(set(call.grads) & set(other.grads))
            if common:
                a = [other.grads[i].double() / scale for i in common]
                row.grad = _worst(row.grad, rel_error(a, [call.grads[i] for i in common]))
                z, nz = flushed([other.grads[i] for i in common], [call.grads[i] for i in common])
                self._flush(row, z, nz)
            own = [n for n, _ in m32.get_submodule(call.name).named_parameters(recurse=False)]
            for local in own if call.index == 0 else ():
                qual = f"{call.name}.{local}" if call.name else local
                if qual in g32 and qual in g_r:
                    z, nz = flushed([g_r[qual]], [g32[qual]])
                    self._flush(row, z, nz)
                if qual in kept:
                    self._kept.setdefault(call.name, [0.0, 0.0])
                    self._kept[call.name][0] += kept[qual][0]
                    self._kept[call.name][1] += kept[qual][1]
            rp = replays.get((call.name, call.index))
            if isinstance(rp, str):
                row.unmeasured = rp
            elif rp is not None:
                row.received_overflow |= rp.received_overflow
                row.nonfinite_op = row.nonfinite_op or rp.nonfinite_op
                row.added = _worst(row.added, rp.added)
                row.grad_added = _worst(row.grad_added, rp.grad_added)
                row.made_nonfinite |= rp.made_nonfinite
                row.unchanged &= rp.unchanged
            elif row.unmeasured is None:
                row.unchanged = False

    def _row(self, m32: nn.Module, call: Call) -> ModuleError:
        row = self.rows.get(call.name)
        if row is None:
            row = self.rows[call.name] = ModuleError(call.name, type(m32.get_submodule(call.name)).__name__,
                                                     len(self.rows), call.parent, 0, "-", False)
        if call.index + 1 > row.calls:
            row.calls = call.index + 1
        return row

    def _flush(self, row: ModuleError, zeroed: int, nonzero: int) -> None:
        self.zeroed += zeroed
        self.nonzero += nonzero
        if nonzero:
            row.flushed = max(row.flushed or 0.0, zeroed / nonzero)

    @property
    def flushed_share(self) -> float | None:
        return self.zeroed / self.nonzero if self.nonzero else None

    def modules(self, islands: set[str]) -> list[ModuleError]:
        rows = sorted(self.rows.values(), key=lambda r: r.order)
        for r in rows:
            r.island = any(r.name == i or r.name.startswith(i + ".") or i == "" for i in islands)
            k = self._kept.get(r.name)
            if k is not None and k[1] > 0:
                r.kept = k[0] / k[1]
        return rows


def _worst(old: float | None, new: float) -> float:
    if new != new:  # NaN: not comparable (shapes), keeps the old
        return old if old is not None else new
    return new if old is None or old != old or new > old else old
