"""The island search of ``compare --explain`` against an oracle that knows the culprits: it finds
them, asks no set twice, and its number of runs grows with the log of the module count."""

from __future__ import annotations

import math
import random

import pytest

from mixprec.comparison.explain.search import IslandSearch, Tree


def balanced(leaves: int, branching: int) -> tuple[dict[str, list[str]], list[str]]:
    """A tree whose nodes have ``branching`` children each, ``leaves`` leaves (a power of it)."""
    children: dict[str, list[str]] = {}
    level = [""]
    while len(level) < leaves:
        nxt = []
        for node in level:
            children[node] = [f"{node}.{i}".lstrip(".") for i in range(branching)]
            nxt += children[node]
        level = nxt
    return children, level


def covers(culprits: set[str]):
    """The oracle: tracks iff every culprit is an island or inside one."""
    def ok(s: frozenset[str]) -> bool:
        return all(any(c == x or c.startswith(x + ".") or x == "" for x in s) for c in culprits)
    return lambda sets: [ok(s) for s in sets]


def ranked(children: dict[str, list[str]], culprits: set[str], how: str, seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)
    out = {}
    for node, kids in children.items():
        bad = [k for k in kids if any(c == k or c.startswith(k + ".") for c in culprits)]
        rest = [k for k in kids if k not in bad]
        if how == "random":
            kids = list(kids)
            rng.shuffle(kids)
        out[node] = bad + rest if how == "good" else rest + bad if how == "bad" else kids
    return out


@pytest.mark.parametrize("how", ["good", "bad", "random"])
@pytest.mark.parametrize("branching", [2, 4, 8])
def test_one_culprit_is_found_at_the_leaf_with_runs_growing_like_log_of_the_module_count(how, branching):
    runs = {}
    for leaves in (branching**2, branching**3, branching**4):
        children, level = balanced(leaves, branching)
        culprit = level[len(level) // 3]
        search = IslandSearch(Tree(ranked(children, {culprit}, how)), covers({culprit}))
        assert search.run() == [culprit]
        n = Tree(children).size()
        runs[n] = search.log.runs
        depth = round(math.log(leaves, branching))
        if how == "good":
            assert search.log.runs == depth + 1  # one run per level, plus the whole model first
        # never more than the bound per level: 2 (top, all) + log2(branching) (bisection) + 1
        assert search.log.runs <= 1 + depth * (3 + math.ceil(math.log2(branching)))
        assert search.log.runs <= Tree(children).bound() + 1
    # linear growth would multiply the runs by the branching factor per size step; log adds a constant
    sizes = sorted(runs)
    steps = [runs[b] - runs[a] for a, b in zip(sizes, sizes[1:])]
    assert max(steps) <= 3 + math.ceil(math.log2(branching)), runs


def test_the_fault_in_a_modules_own_code_returns_that_module():
    # blocks.1's children do not help: the op that needs fp32 is in blocks.1's own forward body
    children = {"": ["blocks.0", "blocks.1", "head"], "blocks.1": ["blocks.1.q", "blocks.1.k"]}
    search = IslandSearch(Tree(children), covers({"blocks.1"}))
    assert search.run() == ["blocks.1"]
    # it looked inside: every child of blocks.1 as an island did not track
    assert (frozenset({"blocks.1.q", "blocks.1.k"}), False) in search.log.asked


def test_two_culprits_in_different_branches_are_both_found():
    children, level = balanced(64, 4)
    culprits = {level[5], level[50]}
    for how in ("good", "bad"):
        search = IslandSearch(Tree(ranked(children, culprits, how)), covers(culprits))
        assert sorted(search.run()) == sorted(culprits)


def test_nothing_found_when_even_the_whole_model_as_an_island_does_not_track():
    children, _ = balanced(16, 4)
    search = IslandSearch(Tree(children), lambda sets: [False] * len(sets))
    assert search.run() is None
    assert search.log.runs == 1


def test_no_set_is_asked_twice_and_parallel_jobs_take_fewer_rounds():
    children, level = balanced(256, 4)
    culprit = level[-1]
    rounds = {}
    for jobs in (1, 3):
        batches = []

        def oracle(sets, batches=batches):
            batches.append(len(sets))
            return covers({culprit})(sets)

        search = IslandSearch(Tree(ranked(children, {culprit}, "bad")), oracle, jobs=jobs)
        assert search.run() == [culprit]
        asked = [s for s, _ in search.log.asked]
        assert len(asked) == len(set(asked))
        assert max(batches) <= max(jobs, 2)
        rounds[jobs] = len(batches)
    assert rounds[3] < rounds[1]
