"""Keeping the ranks in step: what a rank does when its step raised, and the check every step makes.

Ranks are paired collective by collective: the n-th collective of one rank meets the n-th of every
other. A rank whose step raised and who then carries on (the user caught the exception) is either
still paired with the others or not, and the replicas either still agree or not. ``Alignment``
tracks which, with two pieces of book-keeping:

- the group's collective count (``ProcessGroup._get_sequence_number_for_group``, which gloo and
  nccl keep) at the last *rest point*: the start of a forward, the end of a micro-step's backward
  outside the boundary, the end of the skip decision and of the clip. A rank that raised after
  issuing a collective since its last rest point has left the others inside a sequence of
  collectives it will not finish; so has one whose synchronising DDP backward raised (DDP's reducer
  stays waiting). Such a rank is *broken*: it re-raises its exception with a note, and from then on
  refuses every collective (forward, step, checkpoint) with ``DesyncError``. The others raise when
  their collective times out (the process group's timeout), and are broken too.
- an *abort record* carried by the next skip decision: the all-reduce (MAX) that makes the loss
  scaler's inf/NaN flag the same on every rank also carries each rank's step count, the kind of
  abort it made since (none; its window discarded before any communication; its step raised after
  the skip decision; part of its accumulation window discarded) and whether it still waits for a
  checkpoint. Under ``parallel=`` a discarded micro-step keeps its place in the window, so that every
  rank's boundary stays at the same call. If every rank reports the same whole-window or
  after-decision abort, training goes on (every rank discarded alike, as one process does). If not,
  or when part of a window was discarded (that window would be a partial one), every rank raises
  the same ``DesyncError`` from that decision, before any optimizer steps. When the replicas may differ (a
  step raised after the decision on some ranks only, or the step counts differ) the error repeats
  at every step until every rank loads a checkpoint (``mp.load_state_dict``).

The decision is a 6-number all-reduce and one host read of it per optimizer step (fp16 recipes
always had the all-reduce of the flag; the others gain it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

#: the kinds of abort a rank reports at the next decision (MAX and MIN over the ranks are compared):
#: none; a window discarded (the next starts afresh); a step that raised after its skip decision; a
#: window discarded in the middle, which goes on to the boundary the other ranks have (PARTIAL)
NONE, WINDOW, AFTER_DECISION, PARTIAL = 0, 1, 2, 3

_RESTART = ("no rank can train on in this process group: restart the job (torchrun --max-restarts does) and "
            "resume from the last checkpoint (docs/distributed.md, 'When a step raises on one rank')")


class DesyncError(RuntimeError):
    """The ranks are out of step: a step raised on some ranks and not others (and was caught), or their
    step counts differ. Raised on every rank alike; the message says which ranks, what happened and
    what to do."""


def _what(error: BaseException | None) -> str:
    if error is None:
        return "mp.reset() without an exception"
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= 200 else text[:197] + "..."


class Alignment:
    """This rank's place in the sequence of collectives, and what it owes the next skip decision."""

    def __init__(self, group: Any, groups: list[Any], rank: int, mode: str) -> None:
        self.group = group  # the decision's group (None: the default group)
        self._groups = groups  # every process group the strategy's collectives use
        self.rank = rank
        self.mode = mode
        self._rest = self.count()
        self.open = False  # a training micro-step is in progress (a forward with grad, or a backward)
        self.decided = False  # the skip decision is made and the optimizer step is not finished
        self.interrupted = False  # a synchronising (DDP) backward raised
        self.code, self.what = NONE, ""  # the abort this rank reports at the next decision
        self.diverged = ""  # why the replicas may differ; until this rank loads a checkpoint
        self.broken = ""  # why this rank may issue no collective any more

    # ------------------------------------------------------------------ the collective count

    def count(self) -> int | None:
        """The collectives issued so far on the strategy's groups (None: a backend that does not say)."""
        try:
            return sum(int(g._get_sequence_number_for_group()) for g in self._groups)
        except (AttributeError, RuntimeError):
            return None

    def rest(self) -> None:
        """Every collective this rank started so far has its counterpart on the other ranks."""
        self._rest = self.count()

    def require_usable(self) -> None:
        if self.broken:
            raise DesyncError(self.broken)

    # ------------------------------------------------------------------ aborts

    def discard(self, *, partial: bool, in_window: bool) -> int | None:
        """``mp.reset()`` ran; ``partial``: the window goes on (to the boundary the other ranks have),
        ``in_window``: a window was in progress. The exception being handled, if any, is why.
        Returns the abort recorded (None: none, or the rank is broken)."""
        error = sys.exc_info()[1]
        if isinstance(error, DesyncError) or self.broken:
            return None
        count = self.count()
        if self.interrupted or count is None or count != self._rest:
            where = "a backward that synchronises (DDP)" if self.interrupted else "its communication"
            self.broken = (f"this rank's step stopped partway through {where} ({_what(error)}). Either this rank "
                           "raised there while the other ranks went on (they wait in a collective it will not join, "
                           "and raise DesyncError when the process group's timeout passes), or another rank raised, "
                           f"died or stopped, and this rank's collective failed. The ranks cannot be paired again, so "
                           f"{_RESTART}.")
            if error is not None:
                error.add_note(f"mixprec: {self.broken}")
            return None
        if self.decided:
            code = AFTER_DECISION
        elif partial:
            code = PARTIAL
        elif in_window:
            code = WINDOW
        else:
            return None  # nothing in progress: nothing discarded
        if code >= self.code:
            self.code, self.what = code, _what(error)
        self.open = self.decided = False
        return code

    def break_(self, why: str) -> None:
        self.broken = f"this rank could not finish its part of a step ({why}), so {_RESTART}."

    def stepped(self) -> None:
        self.decided = False

    def loaded(self) -> None:
        self.diverged = ""
        self.code, self.what = NONE, ""

    # ------------------------------------------------------------------ the decision

    def exchange(self, found: torch.Tensor | None, steps: int, device: torch.device) -> None:
        """The skip decision (``found``, in place: the largest over the ranks) and the check that every
        rank reports the same; raises ``DesyncError`` on every rank alike when they do not."""
        self.require_usable()
        code = float(self.code)
        vec = torch.tensor([0.0, code, -code, float(steps), -float(steps), 1.0 if self.diverged else 0.0],
                           dtype=torch.float64, device=found.device if found is not None else device)
        if found is not None:
            vec[0] = found.reshape(()).to(torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
        if found is not None:
            found.copy_(vec[0])
        _, high, low, most, fewest, waiting = vec.tolist()  # (one host read)
        self.open, self.decided = False, True
        same = high == -low and most == -fewest and not waiting and high != PARTIAL
        if same:
            self.code, self.what = NONE, ""
            self.rest()
            return
        world = dist.get_world_size(self.group)
        records: list[Any] = [None] * world
        dist.all_gather_object(records, {"code": self.code, "what": self.what, "steps": steps,
                                         "diverged": self.diverged}, group=self.group)
        self.rest()
        self.code, self.what, self.decided = NONE, "", False
        sticky = high == AFTER_DECISION or most != -fewest or waiting
        message = _message(records, sticky)
        if sticky and not self.diverged:
            self.diverged = message
        raise DesyncError(message)


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def _message(records: list[dict[str, Any]], sticky: bool) -> str:
    steps = sorted({r["steps"] for r in records})
    parts = []
    for code, says in ((AFTER_DECISION, "raised after the skip decision of its last step (in optimizer.step, the "
                                        "scheduler, or what runs after them) and the exception was caught"),
                       (WINDOW, "discarded its step before its communication"),
                       (PARTIAL, "discarded part of its accumulation window (the other micro-steps go on to the same "
                                 "boundary; gradients FSDP2 accumulated are dropped with the window on every rank)")):
        rs = [i for i, r in enumerate(records) if r["code"] == code]
        if rs:
            whats = sorted({records[i]["what"] for i in rs})
            parts.append(f"{_ranks(rs)} {says} ({'; '.join(whats)})")
    if len(steps) > 1:
        by = ", ".join(f"rank {i}: {r['steps']}" for i, r in enumerate(records))
        parts.append(f"the ranks have taken different numbers of optimizer steps ({by})")
    waiting = [i for i, r in enumerate(records) if r["diverged"]]
    if waiting:
        parts.append(f"{_ranks(waiting)} have not loaded a checkpoint since the replicas went apart")
    quiet = [i for i, r in enumerate(records) if r["code"] == NONE and not r["diverged"]]
    if quiet and not waiting:
        parts.append(f"{_ranks(quiet)} did not")
    head = f"the ranks are out of step at optimizer step {steps[-1] + 1}: " + "; ".join(parts) + "."
    if sticky:
        return (head + " The replicas may differ from here on (an optimizer stepped on some ranks only, or the ranks "
                "resumed from different states), so every rank raises this at every step until every rank loads "
                "the same checkpoint (mixprec.distributed.load_checkpoint).")
    return head + (" No rank takes this optimizer step: the window is discarded on every rank alike, and training "
                   "can go on with the next one.")
