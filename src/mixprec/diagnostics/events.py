"""What the NaN guard reports: ``NonFiniteEvent`` (where the first NaN/Inf appeared, and why),
and the error and warning that carry it. Causes are read by ``causes.explain``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mixprec.diagnostics._stats import TensorRange
from mixprec.diagnostics.causes import Cause, explain

__all__ = ["NonFiniteError", "NonFiniteEvent", "NonFiniteWarning"]


class NonFiniteError(FloatingPointError):
    """Raised by a guard in ``raise`` mode; ``.event`` says where and why."""

    def __init__(self, event: "NonFiniteEvent") -> None:
        super().__init__(event.describe())
        self.event = event


class NonFiniteWarning(RuntimeWarning):
    """Issued by a guard in ``warn`` mode."""


@dataclasses.dataclass(frozen=True)
class NonFiniteEvent:
    """Where a NaN/Inf first appeared in one forward or backward pass.

    Attributes:
        phase: "forward" or "backward".
        module: qualified name of the innermost module running the producer ("" is the model
            itself; None when the op ran outside the model, e.g. in the loss).
        module_type: its class name.
        op: the torch call ("matmul", "log", "div"); None when only the module's output was seen.
        node: backward only: the autograd node (``LogBackward0``).
        kind: "nan" or "inf".
        dtype, shape: of the offending output (forward) or gradient (backward).
        inputs: ranges of what the producer received (backward: the gradients that came in).
        origin: "producer" (made here from finite inputs), "constant" (made here by a NaN passed
            as a number: ``x * float("nan")``), "input" (it arrived non-finite from outside what
            the guard watches: the batch, the model's own parameters, or the loss in backward), or
            "unlocated" (an on-fault guard's check saw it, and no producer was seen: ``replay`` says
            why; module and op are None, never guessed).
        held_by: with origin "input", the model's parameters and buffers that hold such a value
            (``"parameter 'lin.weight'"``): where it came from when not from the batch.
        where: source line ``file.py:LINE in function`` of the op (forward, when known).
        step: how many forward passes of the model the guard had seen (1 = the first).
        scaled, scale: backward overflow while a loss scaler with ``scale`` > 1 was active; the
            scaler skips such steps, so the guard reports but never raises for them.
        replay: None when the full trace saw it live ("every-step"); an on-fault guard's account of
            its replay otherwise (what differed from the original pass, or why none was seen).
        follows: backward only: where the forward fault of the same step was made, when there was
            one. The backward then carries it (log_softmax's backward reads the forward's NaN output):
            a consequence, not a second fault, and its cause says so.
    """

    phase: str
    module: str | None
    module_type: str | None
    op: str | None
    node: str | None
    kind: str
    dtype: Any
    shape: tuple[int, ...]
    inputs: tuple[TensorRange, ...]
    origin: str = "producer"
    where: str | None = None
    step: int = 0
    scaled: bool = False
    scale: float = 1.0
    output: TensorRange | None = None  # the offending output's range (the sign of an infinity)
    held_by: tuple[str, ...] = ()
    replay: str | None = None
    follows: str | None = None

    @property
    def where_text(self) -> str:
        if self.module is None:
            name = "code outside the model"
        else:
            name = f"{self.module or '(model)'} ({self.module_type})"
        return name + (f", op {self.op}" if self.op else "") + (f" [{self.node}]" if self.node else "")

    @property
    def cause(self) -> Cause:
        if self.origin == "unlocated":
            return Cause("unlocated", f"the {self.phase} went non-finite, and no producer was seen: {self.replay}",
                         "rerun the step with nan_guard={'trace': 'every-step'} (every op traced, about 1.5-2x "
                         "the step on small models), or mixprec doctor on a task that reproduces it")
        return explain(self)

    def _infs(self) -> str:
        """"inf", "-inf" or "-inf and inf", from the output's range when it is known."""
        r = self.output
        if r is None:
            return "inf"
        signs = [t for t, hit in (("-inf", r.min == float("-inf")), ("inf", r.max == float("inf"))) if hit]
        return " and ".join(signs) or "inf"

    def describe(self) -> str:
        """A few lines: what, where, the inputs, the likely cause and the fix."""
        what = "NaN" if self.kind == "nan" else "Inf"
        if self.origin == "unlocated":
            c = self.cause
            return "\n".join([f"{what} in {self.phase} (step {self.step}), producer not located: {self.replay}",
                              f"  likely cause [{c.code}]: the guard did not see it made", f"  fix: {c.fix}"])
        verb = "arrived" if self.origin == "input" else "produced"
        lines = [f"{what} {verb} in {self.phase} (step {self.step}) by {self.where_text}"]
        if self.replay:
            lines.append(f"  ({self.replay})")
        if self.where:
            lines.append(f"  at {self.where}")
        out = TensorRange(self.dtype, self.shape, float("nan"), float("nan")) if self.kind == "nan" else None
        lines.append(f"  output: {out}" if out else f"  output: {_fmt_shape(self.dtype, self.shape)} holding {self._infs()}")
        if self.inputs:
            label = "gradients in" if self.phase == "backward" else "inputs"
            lines.append(f"  {label}: " + "; ".join(map(str, self.inputs)))
        elif self.phase == "backward":
            lines.append("  gradients in: from the nodes before it, all finite until here")
        else:
            lines.append("  inputs: no floating-point tensors")
        c = self.cause
        lines.append(f"  likely cause [{c.code}]: {c.text}")
        lines.append(f"  fix: {c.fix}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        c = self.cause
        return {
            "phase": self.phase, "module": self.module, "module_type": self.module_type, "op": self.op,
            "node": self.node, "kind": self.kind, "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape), "inputs": [str(r) for r in self.inputs], "origin": self.origin,
            "where": self.where, "step": self.step, "scaled": self.scaled, "held_by": list(self.held_by),
            "replay": self.replay, "follows": self.follows, "cause": c.code,
            "cause_text": c.text, "fix": c.fix,
        }


def _fmt_shape(dtype: Any, shape: tuple[int, ...]) -> str:
    return str(TensorRange(dtype, shape, 0.0, 0.0)).split(" in ")[0]
