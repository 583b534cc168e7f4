"""The NaN/Inf guard: name the module (and op) that produced the first non-finite value.

    with mixprec.nan_guard(model) as guard:       # mode="raise" by default
        loss = loss_fn(model(x), y)                # forward: every op and module output checked
        loss.backward()                            # backward: every autograd node checked

The producer is the first op (or module) whose output held a NaN while its inputs held none, or an
infinity while its inputs were finite: not the modules the NaN flowed through afterwards. An op
given an infinity on purpose (``masked_fill(mask, float("-inf"))``, ``torch.full(..., -inf)``) is
not a producer; ``allow=`` names other intentional infinities.

Two ways to watch (``trace=``):

- ``"every-step"`` (the default of ``nan_guard``): every pass is traced. Checks are deferred:
  every checked tensor gets one ``aminmax`` on its device; the results are read in one transfer
  when the model's forward returns, when backward starts (ops run after the model, a loss in the
  ``with`` block) and when backward ends: at most three host syncs per step, none per op.
- ``"on-fault"`` (the default of ``MixedPrecision(nan_guard=True)``): one finiteness check of the
  model's outputs per forward and of its gradients per backward; the first pass that fails is
  replayed under the full trace (``diagnostics.replay``), which names the producer.

When the guard is off, or after the ``with`` block, the model carries no hooks at all.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from mixprec.diagnostics._trace import Record, TensorRange, Tracer
from mixprec.diagnostics.events import NonFiniteError, NonFiniteEvent, NonFiniteWarning
from mixprec.diagnostics.fp8_watch import Fp8Saturation, Fp8SaturationWarning, SaturationWatch
from mixprec.diagnostics.producers import AllowRule, contained, find_producer, producers  # noqa: F401  (find_producer: re-exported)
from mixprec.diagnostics.replay import MAX_PENDING, SavedPass, Sentinel

Mode = Literal["raise", "warn", "record"]
_MODES = ("raise", "warn", "record")
Trace = Literal["every-step", "on-fault"]
_TRACES = ("every-step", "on-fault")


class NanGuard:
    """Watches a model for NaN/Inf, forward and backward; ``nan_guard`` documents the arguments.

    Attributes:
        events: what the checks found, oldest first (one per checked pass at most).
        first: the first event, or None.
        contained: forward NaN/Inf that never reached the model's output or the loss (made and
            dropped inside, as T5's relative-position buckets take log(0) and mask it out):
            recorded, never raised or warned about.
        checks: how many passes were checked.
        replays: on-fault mode: how many passes were replayed under the full trace.
        fp8_saturations: fp8 layers whose casts saturated (``diagnostics.fp8_watch``; fp8 models only).
    """

    max_events = 1000

    def __init__(
        self,
        model: nn.Module,
        mode: Mode = "raise",
        *,
        allow: Sequence[str | AllowRule] = (),
        ops: bool = True,
        backward: bool = True,
        scaler: Any = None,
        locate: bool = True,
        trace: Trace = "every-step",
        max_replays: int = 4,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"nan_guard() watches an nn.Module, got {type(model).__name__}")
        if mode not in _MODES:
            raise ValueError(f"nan_guard mode {mode!r} is not one of {', '.join(_MODES)}")
        if trace not in _TRACES:
            raise ValueError(f"nan_guard trace {trace!r} is not one of {', '.join(_TRACES)}: \"every-step\" traces "
                             "every pass, \"on-fault\" checks each pass cheaply and replays a failing one traced")
        if isinstance(max_replays, bool) or not isinstance(max_replays, int) or max_replays < 1:
            raise ValueError(f"nan_guard max_replays must be an integer >= 1, got {max_replays!r}")
        self.trace: Trace = trace
        self.max_replays = max_replays
        self.replays = 0
        self._located = 0  # on-fault: faults reported from a replay (scaled overflows not counted)
        self.model = model
        self.mode: Mode = mode
        self.allow = tuple(AllowRule.parse(a) for a in allow)
        self.scaler = scaler
        self.events: list[NonFiniteEvent] = []
        self.contained: list[NonFiniteEvent] = []  # forward non-finite values that never left the forward
        self._forward_fault: tuple[int, str] | None = None  # (step, where) of the last forward fault reported
        self.checks = 0
        self._warned: set[tuple] = set()
        self.fp8_saturations: list[Fp8Saturation] = []
        self._fp8 = SaturationWatch.for_model(model)
        self._tracer = Tracer(
            model, ops=ops, backward=backward, locate_ops=locate, lazy=True,
            on_forward_end=self._forward_end, on_backward_start=self._backward_start,
            on_backward_end=self._backward_end,
        )
        # on-fault: the root module's light hooks; the tracer above is attached only to replay a pass
        self._sentinel = Sentinel(self, model) if trace == "on-fault" else None

    @classmethod
    def from_flag(cls, model: nn.Module, flag: Any, *, scaler: Any = None) -> "NanGuard | None":
        """The guard for ``MixedPrecision(nan_guard=flag)``: False/None (none), True ("raise"),
        a mode name, or a dict of ``nan_guard`` keyword arguments."""
        if flag is None or flag is False:
            return None
        if flag is True:
            kwargs: dict[str, Any] = {}
        elif isinstance(flag, str):
            kwargs = {"mode": flag}
        elif isinstance(flag, dict):
            kwargs = dict(flag)
        else:
            raise TypeError(f"nan_guard must be a bool, a mode ({', '.join(_MODES)}) or a dict of options; got {flag!r}")
        kwargs.setdefault("scaler", scaler)
        kwargs.setdefault("trace", "on-fault")  # the guard a run leaves on: cheap until something fails
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ lifecycle

    @property
    def attached(self) -> bool:
        return self._sentinel.attached if self._sentinel is not None else self._tracer.attached

    def attach(self) -> "NanGuard":
        """Hook the model (ops inside its forward are watched while it runs)."""
        if self._sentinel is not None:
            self._sentinel.attach()
        else:
            self._tracer.attach()
        if self._fp8 is not None:
            self._fp8.attach()
        return self

    def detach(self) -> None:
        """Remove every hook; the model is as it was."""
        if self._sentinel is not None:
            self._sentinel.detach()
        self._tracer.detach()
        if self._fp8 is not None:
            self._fp8.detach()

    def __enter__(self) -> "NanGuard":
        self.attach()
        if self._sentinel is None:
            self._tracer.enter_scope()  # ops in the block outside the model (the loss) are watched too
            self._tracer.outside_modules = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._sentinel is None:
                self._tracer.exit_scope()
            if exc_type is None:
                self.check()
        finally:
            self._tracer.outside_modules = False
            self.detach()

    # ------------------------------------------------------------------ checks

    @property
    def first(self) -> NonFiniteEvent | None:
        return self.events[0] if self.events else None

    def check(self) -> list[NonFiniteEvent]:
        """Evaluate what was recorded since the last check (one host sync); returns new events.
        (On-fault mode checks at the end of each forward and backward by itself: nothing to do here.)"""
        if self._fp8 is not None:
            self._check_fp8()
        if self._sentinel is not None:
            return []
        records, ranges = self._tracer.take()
        if not records:
            return []
        self.checks += 1
        new = self._analyse(records, ranges, self._tracer.forward_calls)
        for ev in new:
            self._report(ev)
        return new

    def _analyse(self, records: list[Record], ranges: Any, step: int) -> list[NonFiniteEvent]:
        """The events in one checked part of a trace (``contained`` ones are kept, not returned)."""
        if not records or ranges.all_finite:  # the usual pass: nothing to look for, no range objects built
            return []
        new: list[NonFiniteEvent] = []
        for phase in ("forward", "backward"):
            recs = [r for r in records if r.phase == phase]
            if not recs:
                continue
            for found in producers(recs, ranges, self.allow):
                ev = self._event(*found, ranges, step)
                if phase == "forward" and contained(found[0], recs, ranges):
                    # made and dropped inside the forward (T5's log of a 0 relative position, masked out by
                    # torch.where; a value clamped or nan_to_num-ed back): a module around it returned finite
                    # outputs, or the model's output and the loss are finite. Kept in ``contained``, not
                    # reported, and the search goes on: the real fault may come after it in the same pass.
                    if len(self.contained) < self.max_events:
                        self.contained.append(ev)
                    continue
                if phase == "forward":
                    self._note_forward_fault(ev)  # (before it is reported: this pass's backward may follow it)
                elif self._forward_fault is not None and self._forward_fault[0] == step:
                    ev = dataclasses.replace(ev, follows=self._forward_fault[1])  # its consequence, not a cause
                new.append(ev)
                break
        return new

    def _event(self, rec: Record, kind: str, origin: str, ranges: list[TensorRange], step: int) -> NonFiniteEvent:
        bad = [ranges[i] for i in rec.outputs if i is not None and not ranges[i].finite]
        out = bad[0] if bad else ranges[next(i for i in rec.outputs if i is not None)]
        ins = tuple(ranges[i] for i in rec.inputs if i is not None)
        scale = self._scale() if rec.phase == "backward" and origin == "producer" else 1.0
        call = rec.call
        # A value that arrived non-finite may come from the model's own state (a weight a bad step
        # or a load left NaN): name it. One scan of the parameters, only on this rare path.
        held = self._nonfinite_state(kind) if origin == "input" and rec.phase == "forward" else ()
        return NonFiniteEvent(
            phase=rec.phase, module=None if call is None else call.name, module_type=None if call is None else call.type,
            op=rec.op, node=rec.node, kind=kind, dtype=out.dtype, shape=out.shape, inputs=ins, origin=origin,
            where=rec.where, step=step, scaled=scale > 1.0, scale=scale, output=out,
            held_by=held,
        )

    def _nonfinite_state(self, kind: str) -> tuple[str, ...]:
        """Parameters and buffers of the model that hold a NaN (``kind`` "nan") or an infinity."""
        found = []
        with torch.no_grad():
            for prefix, tensors in (("parameter", self.model.named_parameters()), ("buffer", self.model.named_buffers())):
                for name, t in tensors:
                    if t is None or not t.is_floating_point():
                        continue
                    hit = bool(torch.isnan(t).any()) if kind == "nan" else bool(torch.isinf(t).any())
                    if hit:
                        found.append(f"{prefix} {name!r}")
                    if len(found) >= 5:
                        return tuple(found)
        return tuple(found)

    def _scale(self) -> float:
        s = self.scaler
        if s is None or not getattr(s, "is_enabled", lambda: False)():
            return 1.0
        t = getattr(s, "scale_tensor", None)
        return float(t) if t is not None else float(s.get_scale())

    def _note_forward_fault(self, ev: NonFiniteEvent) -> None:
        """Keep the step's first forward fault: what its backward events then follow from."""
        if self._forward_fault is None or self._forward_fault[0] != ev.step:
            self._forward_fault = (ev.step, ev.where_text if ev.origin != "unlocated" else "a forward fault not located")

    def _report(self, ev: NonFiniteEvent) -> None:
        if ev.phase == "forward":
            self._note_forward_fault(ev)
        if len(self.events) < self.max_events:
            self.events.append(ev)
        if ev.scaled or self.mode == "record":
            return
        if self.mode == "raise":
            raise NonFiniteError(ev)
        key = (ev.phase, ev.module, ev.op, ev.kind)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(ev.describe(), NonFiniteWarning, stacklevel=2)

    def _check_fp8(self) -> None:  # every event recorded; what matters warned about once per window (fp8_watch)
        step = self._sentinel.forward_calls if self._sentinel is not None else self._tracer.forward_calls
        sats = self._fp8.take(step, warn=self.mode != "record")  # type: ignore[union-attr]
        self.fp8_saturations += sats[: max(self.max_events - len(self.fp8_saturations), 0)]

    # ------------------------------------------------------------------ on-fault mode

    def _on_fault(self, sentinel: Sentinel, phase: str, passes: list[SavedPass], *, kind: str,
                  bad: list[torch.Tensor], names: Sequence[str] = ()) -> None:
        """A cheap check failed: replay the pass under the full trace and report what it saw."""
        step = passes[-1].step if passes else sentinel.forward_calls
        scale = self._scale() if phase == "backward" else 1.0
        why = self._not_replayable(passes, scale)
        if why is None:
            self.replays += 1
            rep = sentinel.replay(passes, backward=phase == "backward", bad_params=frozenset(names))
            found: list[NonFiniteEvent] = []
            for i, ((records, ranges), s) in enumerate(zip(rep.parts, [*passes, passes[-1]])):
                evs = self._analyse(records, ranges, s.step)
                if phase == "backward" and i < len(passes) and s.faulted:
                    evs = []  # this forward's own fault was reported when it ended
                found += evs
            if found:
                how = f"located by replaying step {step} under the full trace" + "".join(f"; {n}" for n in rep.notes)
                if not all(ev.scaled for ev in found):
                    self._located += 1
                for ev in found:
                    self._report(dataclasses.replace(ev, replay=how))
                return
            if phase == "forward" and kind == "inf" and rep.reproduced:
                sentinel.inf_outputs_expected = True  # asked-for infinities (a mask) reach the outputs
                return
            why = ("a replay of the step under the full trace did not reproduce it" if not rep.reproduced else
                   "a replay of the step reproduced it, but the trace saw no producer") + "".join(f"; {n}" for n in rep.notes)
            if phase == "backward" and _world_size() > 1:
                why += ("; the gradients are averaged over the ranks, so it may come from another rank's pass: "
                        "see that rank's guard")
        seen = (f"the gradients of {', '.join(repr(n) for n in names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                if names else "the model's output")
        out = bad[0]
        self._report(NonFiniteEvent(
            phase=phase, module=None, module_type=None, op=None, node=None, kind=kind, dtype=out.dtype,
            shape=tuple(out.shape), inputs=(), origin="unlocated", step=step, scaled=scale > 1.0, scale=scale,
            replay=f"seen in {seen}; {why}",
        ))

    def _not_replayable(self, passes: list[SavedPass], scale: float) -> str | None:
        """Why a failing pass is not replayed (None: it is)."""
        if not passes:
            return ("not replayed: the guard did not see the forward these gradients came from (it ran before the "
                    f"guard was attached, or more than {MAX_PENDING} forwards ran before this backward)")
        if any(type(p).__name__ == "DTensor" for p in self.model.parameters()):
            return ("not replayed: the model's parameters are sharded (FSDP), and a replay on this rank alone "
                    "would run the shards' collectives without the other ranks")
        if self._located >= self.max_replays and scale <= 1.0:
            return (f"not replayed: {self._located} faults were already located in this run "
                    f"(max_replays={self.max_replays})")
        return None

    def _forward_end(self) -> None:
        self.check()

    def _backward_start(self) -> None:
        self.check()  # ops between the model and backward (the loss), when the block watched them

    def _backward_end(self) -> None:
        self.check()

    def summary(self) -> str:
        fp8 = "".join(f"\n{s.describe()}" for s in self.fp8_saturations[:5])
        if not self.events:
            return f"nan_guard: no non-finite values in {self.checks} checked pass(es)" + fp8
        return "\n\n".join(e.describe() for e in self.events[:5]) + fp8


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def nan_guard(model: nn.Module, mode: Mode = "raise", **options: Any) -> NanGuard:
    """A context manager that names the first module/op producing NaN or Inf, forward and backward.

    Args:
        model: the module to watch (with all its submodules).
        mode: "raise" a ``NonFiniteError`` at the first check that finds one, "warn"
            (``NonFiniteWarning``, once per place), or "record" (``guard.events`` only).

    Options (keyword arguments of ``NanGuard``):
        allow: intentional infinities: an op name (``"add"``), a module glob followed by a colon
            (``"blocks.*.mask:"``) or both (``"blocks.*:add"``); or ``AllowRule`` for NaN too.
            Infinities passed in as values (``masked_fill(m, -inf)``) need no entry.
        ops: watch each torch call inside forwards (``q @ k.transpose(-2, -1)``), not only module outputs.
        backward: watch gradients through the autograd nodes of guarded forwards.
        scaler: a loss scaler; backward overflows while its scale is above 1 are reported as
            scaled overflows (expected, the step is skipped) and never raised.
        locate: note each op's source line (costs a frame walk per op).
        trace: "every-step" (trace every pass: what the options above watch, on every step) or
            "on-fault" (check the model's outputs and gradients once per pass; replay the first
            failing pass under the full trace to name the producer; see docs/diagnostics.md).
        max_replays: on-fault: after this many located faults (warn and record modes go on
            running), later ones are reported as seen but not replayed.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LogSigmoid())
    >>> with torch.no_grad(): _ = net[0].weight.fill_(-1e4)
    >>> with nan_guard(net, mode="record") as guard:
    ...     _ = net(torch.ones(1, 2)).log().sum()
    >>> guard.first.module, guard.first.op, guard.first.kind
    (None, 'log', 'nan')
    """
    return NanGuard(model, mode, **options)
