"""The smallest set of fp32 islands that makes a recipe track: a ranked, hierarchical delta debugging.

The module tree is the *call* tree of one forward: a module's children are the modules it calls
(a ``ModuleList`` is never called; its blocks are children of the module that loops over them).
The search asks an oracle, "does the recipe TRACK with these modules as fp32 islands?", each
question being a short training run, and assumes that more islands never hurt.

At one node, with its children ranked by the error each adds (``capture``):

1. ask, together, for the top-ranked child alone and for all children (both in one batch: with
   ``--jobs 2`` they run at once). The top child alone tracks: it is the culprit at this level (one
   run when the ranking is right). All children do not track: the fault is in the node's own code
   (an op in its ``forward`` body), so the node itself is the island.
2. otherwise bisect the ranked list for the shortest prefix that tracks (``jobs`` points a round,
   so ``log_(jobs+1) n`` rounds), then keep the last child of that prefix alone if it tracks, or
   else drop the others one by one while the rest still tracks (a set with several culprits).
3. descend into each culprit found, the others staying islands, until the node's own code or a
   leaf.

With one culprit among ``n`` modules the number of runs grows with ``log n``: about 1 per level of
the tree when the ranking puts the culprit first, at most ``2 + log2(n_children) + 1`` per level
otherwise (``tests/compare/test_explain_search.py`` counts them on trees of 8 to 1024 modules).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

#: answers, for each set of island names, whether the recipe tracks with them (one batch at a time)
Oracle = Callable[[list[frozenset[str]]], list[bool]]


@dataclasses.dataclass
class Tree:
    """The call tree: ``children[name]`` ranked best suspect first (the root is ``""``)."""

    children: dict[str, list[str]]

    def kids(self, name: str) -> list[str]:
        return self.children.get(name, [])

    def size(self) -> int:
        seen = {n for n in self.children} | {c for cs in self.children.values() for c in cs}
        return len(seen)

    def bound(self, name: str = "") -> int:
        """An upper bound on the runs a one-culprit search below ``name`` needs."""
        kids = self.kids(name)
        if not kids:
            return 0
        here = 2 + math.ceil(math.log2(len(kids))) + 1 if len(kids) > 1 else 1
        return here + max(self.bound(k) for k in kids)


@dataclasses.dataclass
class SearchLog:
    """Every question asked, in order: (islands, tracked)."""

    asked: list[tuple[frozenset[str], bool]] = dataclasses.field(default_factory=list)

    @property
    def runs(self) -> int:
        return len(self.asked)


class IslandSearch:
    """Runs the search (module doc) against ``oracle``; answers are cached, so a set is never asked twice."""

    def __init__(self, tree: Tree, oracle: Oracle, jobs: int = 1) -> None:
        self.tree, self.oracle, self.jobs = tree, oracle, max(1, int(jobs))
        self.cache: dict[frozenset[str], bool] = {}
        self.log = SearchLog()

    def ask(self, sets: Sequence[frozenset[str]]) -> list[bool]:
        todo = list(dict.fromkeys(s for s in sets if s not in self.cache))
        if todo:
            for s, ok in zip(todo, self.oracle(todo)):
                self.cache[s] = bool(ok)
                self.log.asked.append((s, bool(ok)))
        return [self.cache[s] for s in sets]

    def run(self, root: str = "") -> list[str] | None:
        """The island set found, or None when even ``root`` as an island does not track."""
        if not self.ask([frozenset([root])])[0]:
            return None
        return self._descend(root, frozenset())

    def _descend(self, node: str, fixed: frozenset[str]) -> list[str]:
        kids = self.tree.kids(node)
        if not kids:
            return [node]
        chosen = self._subset(kids, fixed)
        if chosen is None:
            return [node]
        found: list[str] = []
        for i, child in enumerate(chosen):
            others = fixed | frozenset(found) | frozenset(chosen[i + 1:])
            found += self._descend(child, others)
        return found

    def _subset(self, kids: list[str], fixed: frozenset[str]) -> list[str] | None:
        """A small subset of ``kids`` that tracks beside ``fixed`` (None: not even all of them)."""
        def with_(items: Sequence[str]) -> frozenset[str]:
            return fixed | frozenset(items)

        if len(kids) == 1:
            return kids if self.ask([with_(kids)])[0] else None
        if self.jobs > 1:  # both at once: the second run costs no wall time
            top, every = self.ask([with_(kids[:1]), with_(kids)])
        else:
            top = self.ask([with_(kids[:1])])[0]
            every = False if top else self.ask([with_(kids)])[0]
        if top:
            return kids[:1]
        if not every:
            return None
        lo, hi = 1, len(kids)  # the prefix of length lo fails, of length hi tracks
        while hi - lo > 1:
            points = _points(lo, hi, self.jobs)
            answers = self.ask([with_(kids[:k]) for k in points])
            passing = [k for k, ok in zip(points, answers) if ok]
            new_hi = min(passing) if passing else hi
            failing = [k for k, ok in zip(points, answers) if not ok and k < new_hi]
            lo, hi = (max(failing) if failing else lo), new_hi
        prefix = kids[:hi]
        last = prefix[-1]
        if self.ask([with_([last])])[0]:
            return [last]
        keep = list(prefix)
        for item in reversed(prefix[:-1]):  # least suspected first
            trial = [k for k in keep if k != item]
            if self.ask([with_(trial)])[0]:
                keep = trial
        return keep


def _points(lo: int, hi: int, jobs: int) -> list[int]:
    """Up to ``jobs`` prefix lengths strictly between lo and hi, evenly spread (one: the middle)."""
    n = min(jobs, hi - lo - 1)
    return sorted({lo + round((hi - lo) * (i + 1) / (n + 1)) for i in range(n)} - {lo, hi}) or [(lo + hi) // 2]
