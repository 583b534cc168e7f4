"""What ``explain`` found: one ``Finding`` per hypothesis, the verified ``Fix``, and the ``Explanation``
that holds them (``render_text`` for the terminal, ``to_dict`` for JSON, ``write`` for the files)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from mixprec.comparison.explain.candidates import Outcome
from mixprec.comparison.explain.capture import Capture, _num
from mixprec.comparison.runner import RunResult
from mixprec.comparison.verdict import Verdict

FindingStatus = Literal["HOLDS", "REJECTED", "NOT APPLICABLE", "NOT TESTED"]
#: TRACKS: nothing to explain; FIXED: a verified fix; NOT FIXED: no single change tracked;
#: FP32 UNSTABLE: fp32 itself is the problem; ERROR: the recipe raised (not a numerical divergence)
Status = Literal["TRACKS", "FIXED", "NOT FIXED", "FP32 UNSTABLE", "ERROR"]

TITLES = {
    "fp32": "fp32 itself is unstable across seeds",
    "islands": "an op or module that needs fp32",
    "masters": "a missing master copy: updates lost to rounding",
    "scale": "an fp16 loss scale (fp8: its tensor scaling) stuck low or overflowing",
    "loss": "a loss or a reduction computed in 16 bits",
}


@dataclasses.dataclass
class Finding:
    """One hypothesis: what was looked at, what was run, and what it says."""

    hypothesis: str
    status: FindingStatus
    conclusion: str
    evidence: list[str] = dataclasses.field(default_factory=list)
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def title(self) -> str:
        return TITLES[self.hypothesis]

    def to_dict(self) -> dict[str, Any]:
        return {"hypothesis": self.hypothesis, "title": self.title, "status": self.status,
                "conclusion": self.conclusion, "evidence": self.evidence, "detail": self.detail,
                "candidates": [outcome_dict(o) for o in self.outcomes]}


def outcome_dict(o: Outcome) -> dict[str, Any]:
    return {"change": o.candidate.change, "hypothesis": o.candidate.hypothesis, "recipe": o.candidate.recipe.name,
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in o.candidate.options},
            "status": o.verdict.status, "message": o.verdict.message, "horizon": o.horizon,
            "steps_run": None if o.run is None else o.run.steps, "stopped": None if o.run is None else o.run.stopped,
            "seconds": round(o.seconds, 3), "verified": None if o.full is None else o.full.to_dict()}


@dataclasses.dataclass
class Fix:
    """The smallest change that tracks, verified on the comparison's full number of steps."""

    outcome: Outcome  # on the short horizon
    code: str
    verdict: Verdict  # on all the steps, against the comparison's band
    run: RunResult  # the verification run (its curve is on the report's plot)
    step_time_vs_recipe: float  # median step time over the failing recipe's (> 1: slower)
    step_time_vs_fp32: float

    @property
    def change(self) -> str:
        return self.outcome.candidate.change

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.change, "hypothesis": self.outcome.candidate.hypothesis, "code": self.code,
                "verdict": self.verdict.to_dict(), "step_time_vs_recipe": _num(round(self.step_time_vs_recipe, 4)),
                "step_time_vs_fp32": _num(round(self.step_time_vs_fp32, 4)),
                "curve": [_num(float(x)) for x in self.run.loss]}


@dataclasses.dataclass
class Explanation:
    """Why a recipe does not track fp32 on a task, and what fixes it (``mixprec.explain``)."""

    task: str
    recipe: str
    device: str
    steps: int
    status: Status
    summary: str
    verdict: Verdict
    comparison: Any  # the ComparisonResult it explains (its fp32 runs and band are reused)
    base: Any = None  # the Recipe explained (the candidates' code is written against it)
    horizon: int | None = None
    capture: Capture | None = None
    findings: list[Finding] = dataclasses.field(default_factory=list)
    fix: Fix | None = None
    alternatives: list[Outcome] = dataclasses.field(default_factory=list)
    culprits: list[str] = dataclasses.field(default_factory=list)
    # the modules that call a culprit and tracked as islands (-> the culprits they call): their own code runs on
    # what the culprit hands them
    callers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    runs: int = 0  # training runs explain made (the comparison's not counted)
    steps_trained: int = 0
    search_runs: int = 0
    module_count: int = 0
    wall_s: float = 0.0
    jobs: int = 1
    files: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def alarming(self) -> bool:
        """False when the recipe tracks: there is nothing to explain and nothing is reported as wrong."""
        return self.status != "TRACKS"

    def finding(self, hypothesis: str) -> Finding:
        return next(f for f in self.findings if f.hypothesis == hypothesis)

    def holds(self) -> list[str]:
        return [f.hypothesis for f in self.findings if f.status == "HOLDS"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mixprec_explain": 1, "task": self.task, "recipe": self.recipe, "device": self.device, "steps": self.steps,
            "status": self.status, "alarming": self.alarming, "summary": self.summary,
            "verdict": self.verdict.to_dict(), "horizon": self.horizon, "culprits": self.culprits,
            "fix": None if self.fix is None else self.fix.to_dict(),
            "alternatives": [outcome_dict(o) for o in self.alternatives],
            "findings": [f.to_dict() for f in self.findings],
            "capture": None if self.capture is None else self.capture.to_dict(),
            "cost": {"runs": self.runs, "steps_trained": self.steps_trained, "search_runs": self.search_runs,
                     "modules": self.module_count, "wall_s": round(self.wall_s, 2), "jobs": self.jobs},
            "files": dict(self.files),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write(self, out: str) -> dict[str, str]:
        """Write explain.html, explain.png and explain.json into ``out``; returns name -> path."""
        from mixprec.comparison.explain.report import write_explanation

        self.files = write_explanation(self, out)
        return self.files

    def render_text(self) -> str:
        """The explanation as plain lines (the CLI prints them)."""
        lines = [f"explain {self.recipe} on {self.task}: {self.status}", f"  {self.summary}"]
        if self.capture is not None:
            entry = self.capture.entry_points()
            u = self.capture.unit_roundoff
            if self.capture.loss_made_nonfinite:
                lines.append(f"  the loss itself made a non-finite value from finite model outputs (computed in "
                             f"{self.capture.loss_dtype})")
            # many modules whose only fault is gradients fp16 flushed: one line (the loss scale's finding says why)
            flushing = [m for m in entry if (m.flushed or 0) >= 0.5 and not m.made_nonfinite
                        and (m.added or 0) < 16 * u]
            if len(flushing) > 3:
                entry = [m for m in entry if m not in flushing]
            shown = entry[:4] if entry or flushing else self.capture.ranked()[:3]
            head = "where the error enters" if entry or flushing else \
                "no module adds more than 16 u by itself; the largest"
            lines.append(f"  {head} ({self.capture.compute}, unit roundoff u = {u:.3g}; measured at steps "
                         f"{', '.join(map(str, self.capture.steps))}):")
            if len(flushing) > 3:
                names = ", ".join(m.label for m in flushing[:5]) + (" ..." if len(flushing) > 5 else "")
                lines.append(f"    the backward of {len(flushing)} modules ({names}): at least half of their gradient "
                             "entries zero where fp32's are not (fp16 underflow)")
            for m in shown:
                lines.append(f"    {m.label} ({m.type}): {_in_u(m, u)}" + _what(m))
            if len(entry) > len(shown):
                lines.append(f"    ... and {len(entry) - len(shown)} more")
        for f in self.findings:
            lines.append(f"  [{f.status}] {f.title}: {f.conclusion}")
            for line in f.evidence if f.status != "NOT APPLICABLE" else ():
                lines.append(f"      - {line}")
            for o in f.outcomes:
                full = "" if o.full is None else f"; over all {self.steps} steps: {o.full.status}"
                lines.append(f"      {o.verdict.status:10s} {o.candidate.change} ({_steps(o)}{full})")
        if self.fix is not None:
            lines.append(f"  fix (verified: {self.fix.verdict.status} over all {self.steps} steps; step time "
                         f"x{self.fix.step_time_vs_recipe:.2f} the recipe's, x{self.fix.step_time_vs_fp32:.2f} fp32's):")
            lines.append(f"    {self.fix.code}")
        for o in self.alternatives:
            lines.append(f"  also tracks on {o.horizon} steps: {o.candidate.code(self.base)}")
        if self.runs:
            lines.append(f"  cost: {self.runs} training runs ({self.steps_trained} steps; the island search "
                         f"{self.search_runs} of them, over {self.module_count} modules), {self.wall_s:.0f} s, "
                         f"--jobs {self.jobs}")
        return "\n".join(lines)


def _in_u(m: Any, u: float) -> str:
    if m.made_nonfinite:
        return "makes a non-finite value from fp32's finite input" + (f" (first: {m.nonfinite_op})"
                                                                       if m.nonfinite_op else "")
    x = m.score
    return f"adds {x:.2g} relative error by itself ({x / u:.3g} u)"


def _what(m: Any) -> str:
    bits = []
    if m.grad_overflow:
        bits.append("its backward overflowed at the loss scale")
    if m.flushed:
        bits.append(f"{m.flushed:.0%} of its gradient entries zero where fp32's are not")
    if m.kept is not None and m.kept < 0.5:
        bits.append(f"its stored weights kept {max(m.kept, 0):.0%} of the update")
    return ("; " + "; ".join(bits)) if bits else ""


def _steps(o: Outcome) -> str:
    if o.run is None:
        return o.verdict.message
    note = f", {o.run.stopped}" if o.run.stopped else ""
    return f"{o.run.steps}/{o.horizon} steps{note}"
