"""Which record of a trace made the first non-finite value, and whether it left the forward.

The producer is the first op (or module) whose output held a NaN while its inputs held none, or an
infinity while its inputs were finite. A producer whose value never reached what leaves the forward
(an enclosing module's outputs are all finite, or the model's and the loss's are) is *contained*:
T5 takes the log of a 0 relative position on every step and masks it out with ``torch.where``. The
guard keeps such producers aside and looks on for the next one: a pass can hold both the harmless
one and the real fault after it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator, Sequence

from mixprec.diagnostics._trace import ModuleCall, Record, TensorRange

__all__ = ["AllowRule", "contained", "find_producer", "producers"]


@dataclasses.dataclass(frozen=True)
class AllowRule:
    """An intentional non-finite value: ``module`` (glob on the qualified name, "*" for any),
    ``op`` (None for any), and the kinds allowed (infinities only, by default)."""

    module: str = "*"
    op: str | None = None
    kinds: tuple[str, ...] = ("inf",)

    @classmethod
    def parse(cls, spec: "str | AllowRule") -> "AllowRule":
        """``"masked_fill"`` (an op anywhere), ``"blocks.*.attn:"`` (a module), ``"blocks.*:add"`` (both)."""
        if isinstance(spec, AllowRule):
            return spec
        if not isinstance(spec, str) or not spec:
            raise TypeError(f"allow entries are strings like 'op', 'module:' or 'module:op', or AllowRule; got {spec!r}")
        if ":" in spec:
            module, _, op = spec.partition(":")
            return cls(module or "*", op or None)
        return cls("*", spec)

    def matches(self, call: ModuleCall | None, op: str | None, kind: str) -> bool:
        if kind not in self.kinds:
            return False
        if self.op is not None and self.op != op:
            return False
        if self.module == "*":
            return True
        return call is not None and any(fnmatch.fnmatchcase(c.name, self.module) for c in call.ancestors())


def _flags(bad: dict[int, tuple[bool, bool]], idx: Sequence[int | None]) -> tuple[bool, bool]:
    nan = inf = False
    for i in idx:
        f = bad.get(i)  # type: ignore[arg-type]  (None is never a key)
        if f is not None:
            nan |= f[0]
            inf |= f[1]
    return nan, inf


def _nonfinite(ranges: Sequence[TensorRange]) -> dict[int, tuple[bool, bool]]:
    """``{index: (nan, inf)}`` of the ranges that are not finite."""
    bad = getattr(ranges, "nonfinite", None)
    if bad is None:
        bad = {i: (r.nan, r.inf) for i, r in enumerate(ranges) if not r.finite}
    return bad


def find_producer(
    records: list[Record],
    ranges: list[TensorRange],
    allow: Sequence[AllowRule] = (),
) -> tuple[Record, str, str] | None:
    """The first record that made a non-finite value from finite inputs: (record, kind, origin)
    (``producers``' first answer)."""
    return next(producers(records, ranges, allow), None)


def producers(
    records: list[Record],
    ranges: list[TensorRange],
    allow: Sequence[AllowRule] = (),
) -> Iterator[tuple[Record, str, str]]:
    """The records that made a non-finite value from finite inputs, in order: (record, kind, origin).

    A NaN producer's inputs held no NaN; an Inf producer's inputs (and Python scalars) were
    finite. Module-level records count only when no op inside that call made or carried a
    non-finite value (the op, when seen, is the better answer). With no producer, the first
    record that received a non-finite value is given with origin "input". Backward nodes fed
    by watched nodes carry no incoming ranges (see ``Tracer._on_node``): they are judged by what
    came before them in the pass. After a producer, the modules around it carry its value: they
    are not producers.
    """
    bad = _nonfinite(ranges)
    tainted: set[int] = set()
    intentional = False  # an infinity asked for (a -inf scalar, an allowed producer) was seen
    first_bad_input: tuple[Record, str] | None = None
    found = False
    for rec in records:
        out_nan, out_inf = _flags(bad, rec.outputs)
        if not (out_nan or out_inf):
            continue
        t_nan, t_inf = _flags(bad, rec.inputs)
        # An infinity passed as a number is asked for (masked_fill(m, -inf)); a NaN passed as a
        # number is not a mask anyone means: the op that multiplied by float("nan") made the NaN.
        in_nan, in_inf = t_nan, t_inf or rec.scalar_inf
        kind = "nan" if out_nan else "inf"
        if rec.op is None and rec.node is None and rec.call is not None and id(rec.call) in tainted:
            continue
        if rec.op is not None and rec.call is not None:
            tainted.update(id(c) for c in rec.call.ancestors())
        produced = (out_nan and not in_nan) or (not out_nan and out_inf and not (in_nan or in_inf))
        if produced and rec.node is not None and not rec.inputs and (first_bad_input or intentional):
            # A backward node whose incoming gradient the tracer did not measure (watched ops sent
            # it); a non-finite value is already about, so it may have carried that one.
            produced = False
        if produced:
            if any(a.matches(rec.call, rec.op, kind) for a in allow):
                intentional = True
                if rec.call is not None:  # the modules around it carry the allowed value, they do not make it
                    tainted.update(id(c) for c in rec.call.ancestors())
                continue
            yield rec, kind, "constant" if kind == "nan" and rec.scalar_nan else "producer"
            found = True
            if rec.call is not None:
                tainted.update(id(c) for c in rec.call.ancestors())
            continue
        if rec.scalar_inf and not (t_nan or t_inf):
            intentional = True
        elif first_bad_input is None and not intentional and (t_nan or t_inf):
            first_bad_input = (rec, "nan" if t_nan else "inf")
    if first_bad_input is not None and not found:
        yield first_bad_input[0], first_bad_input[1], "input"


def _escapes(records: Sequence[Record], ranges: Any) -> bool:
    """Whether a non-finite value reached what leaves the forward: the model's output (its root
    call's record) or an op run after it (the loss). True when the records hold neither (a check
    made mid-forward: nothing is known to be contained)."""
    bad = _nonfinite(ranges)
    final = [r for r in records if r.call is None or (r.op is None and r.node is None and r.call.parent is None)]
    if not final:
        return True
    return any(any(f) for r in final for f in [_flags(bad, r.outputs)])




def contained(rec: Record, records: Sequence[Record], ranges: Sequence[TensorRange]) -> bool:
    """Whether the non-finite value ``rec`` made in the forward stayed inside: a module call around it
    returned only finite outputs (its record comes after ``rec``'s), or nothing that leaves the forward
    (the model's output, the loss) is non-finite."""
    if not _escapes(records, ranges):
        return True
    if rec.call is None:
        return False
    bad = _nonfinite(ranges)
    around = {id(c) for c in rec.call.ancestors()}
    if rec.op is None:  # a module's own record: the modules around it, not itself
        around.discard(id(rec.call))
    for r in records:
        if r.op is None and r.node is None and r.call is not None and id(r.call) in around and r.outputs \
                and r is not rec and not any(_flags(bad, r.outputs)):
            return True
    return False
