"""The records ``flow`` makes of a training step, and how two of them relate.

An ``Event`` is one call that matters (a backward, a clip, a scaler step...) with where it runs:
its autocast regions (``ctx``), the branches and loops around it (``path``), the frames it was
inlined through (``frames``) and its order. ``exclusive`` and ``opposite_arms`` say when two
events cannot run in one pass. Keys of objects are in the analysed function's terms; a local of
an inlined helper gets its frame's number (``opt@3``) so that two helpers' locals named alike
are not taken for one object, and ``show`` drops it for messages.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass, field

from mixprec.lint.dtypes import Autocast

_TAG = re.compile(r"@[gm]?\d+")


def show(key: str | None) -> str:
    """A key as the code spells it (``opt@3.param_groups`` -> ``opt.param_groups``)."""
    return _TAG.sub("", key or "")


def frame_of(key: str | None) -> int | None:
    """The frame a helper's local belongs to (``opt@3`` -> 3), or None."""
    match = re.search(r"@(\d+)", key or "")
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Region:
    """An autocast region in force; ``site`` as for events."""

    autocast: Autocast
    site: ast.Call | None


@dataclass(frozen=True)
class Branch:
    """One arm of an if/try/match. ``ends`` says how the arm leaves when its last statement
    does ("return", "raise", "loop" for continue/break); ``guard`` that the test looks like a
    manual inf check."""

    node_id: int
    arm: int
    ends: str | None
    guard: bool
    frame: int
    cond: tuple[str, bool] | None = None  # an ``if`` arm: (stable test, whether it holds here)
    test: ast.expr | None = field(default=None, compare=False, hash=False)  # an ``if`` arm's test


@dataclass(frozen=True)
class Loop:
    node_id: int
    targets: frozenset[str]
    frame: int
    # names that change from one iteration to the next: the targets and the names the body binds
    varying: frozenset[str] = field(default=frozenset(), compare=False, hash=False)


@dataclass
class Event:
    kind: str
    node: ast.AST
    ctx: tuple[Region, ...]
    path: tuple[Branch | Loop, ...]
    site: ast.Call | None
    frames: tuple[int, ...]
    order: int
    scaler: str | None = None  # the GradScaler involved (key in the analysed function's terms)
    target: str | None = None  # the optimizer stepped or unscaled, or the scheduler stepped
    loss: str = "plain"  # for backward: "scaled", "plain", "unknown" or "managed" (a framework scales it)
    name: str | None = None  # for loss_call: the loss's name
    sensitivity: object = None  # for loss_call: where the loss is 16-bit-sensitive (losses.Sensitivity)
    # for a backward() by Accelerate: the ``mixed_precision`` values its Accelerator may have (None: not in sight)
    precisions: frozenset | None = field(default=None, compare=False)
    script: object = field(default=None, repr=False)  # the Script ``node`` is in

    @property
    def region(self) -> Region | None:
        """The innermost autocast region, when it is (or may be) enabled."""
        if not self.ctx or self.ctx[-1].autocast.enabled is False:
            return None
        return self.ctx[-1]

    @property
    def loops(self) -> tuple[Loop, ...]:
        return tuple(p for p in self.path if isinstance(p, Loop))

    @property
    def line(self) -> int:
        """The line to name in a message: the call in the analysed function that led here."""
        return (self.site or self.node).lineno


def exclusive(a: Event, b: Event) -> bool:
    """True when ``a`` (earlier) and ``b`` cannot both run in one pass: other arms of one
    if/try/match, or ``a`` sits in an arm that returns, raises or continues before ``b``."""
    for pa, pb in zip(a.path, b.path):
        if pa == pb:
            continue
        if isinstance(pa, Branch) and isinstance(pb, Branch) and pa.node_id == pb.node_id and pa.frame == pb.frame:
            return True
        break
    for i, element in enumerate(a.path):
        if not isinstance(element, Branch) or not element.ends or element in b.path:
            continue
        if element.ends == "raise":
            return True
        if element.ends == "return" and element.frame in b.frames:
            return True
        if element.ends == "loop":
            loop = next((p for p in reversed(a.path[:i]) if isinstance(p, Loop)), None)
            if loop is not None and loop in b.path:
                return True
    return False


def exclusive_either(a: Event, b: Event) -> bool:
    first, second = sorted((a, b), key=lambda e: e.order)
    return exclusive(first, second)


def opposite_arms(a: Event, b: Event) -> bool:
    """True when ``a`` and ``b`` sit in arms of ``if`` statements whose (stable) tests disagree:
    ``if amp: <a>`` and, later, ``if amp: ... else: <b>`` never run in one pass. The tests are
    compared in the analysed function's terms, so a flag passed to a helper is the same flag."""
    conds = {p.cond for p in a.path if isinstance(p, Branch) and p.cond is not None}
    return any((p.cond[0], not p.cond[1]) in conds for p in b.path if isinstance(p, Branch) and p.cond is not None)


def unrelated(a: Event, a_key: str | None, b: Event, b_key: str | None) -> bool:
    """True when ``a``'s object and ``b``'s are locals of two helpers called one after the
    other (neither inlined inside the other): ``train_fp16()`` then ``train_fp32()`` are two
    steps, not one."""
    fa, fb = frame_of(a_key), frame_of(b_key)
    return fa is not None and fb is not None and fa not in b.frames and fb not in a.frames


def place(event: Event, *others: Event | Region) -> ast.AST | None:
    """Where to report a finding about ``event`` that also involves ``others``.

    None when everything involved happened inside one call to a helper: the helper's own
    analysis reports it there, once.
    """
    sites = {event.site, *(o.site for o in others)}
    if event.site is None:
        return event.node
    if None in sites or len(sites) > 1:
        return event.site
    return None


def via(event: Event) -> str:
    return f" (in {ast.unparse(event.site.func)}())" if event.site is not None else ""


def before(events: list[Event], later: Event) -> Event | None:
    """The last of ``events`` (in order) that runs before ``later`` in the same pass."""
    for e in reversed(events[: bisect.bisect_left(events, later.order, key=_order)]):
        if not exclusive(e, later):
            return e
    return None


def between(events: list[Event], first: Event, later: Event) -> list[Event]:
    """The ``events`` (in order) strictly between ``first`` and ``later``."""
    return events[bisect.bisect_right(events, first.order, key=_order) : bisect.bisect_left(events, later.order, key=_order)]


def _order(event: Event) -> int:
    return event.order
