"""How many training runs ``compare --explain`` needs as the model grows.

A residual MLP of ``depth`` blocks (Linear, a norm, Tanh each); one block's norm is replaced by a
hand-written normalisation that computes its variance in the dtype it receives (E[x^2] - E[x]^2,
catastrophic in bf16 for inputs of mean ~8). ``mixprec.explain(task, "bf16-mixed")`` must name
that module and verify the fix; the script counts the runs the island search took, and all of
explain's runs, for several depths, two ways:

- ``ranked``: as explain runs (the capture ranks the modules; the top entry point is tried first);
- ``unranked``: the ranking withheld (every module's children in reverse rank order, so the
  culprit comes last, and no entry-point guess): the bisection alone, its worst case.

It also runs the search alone against an exact oracle (it tracks iff the culprit is covered) on
balanced trees of 15 to 4681 modules, culprit ranked first ("good"), last ("bad") or at random:
what the search costs when every verdict is right (instant, no training).

    python benchmarks/explain_search.py                       # depths 2 5 10 21: ~11 to ~87 modules
    python benchmarks/explain_search.py --depths 2 5 --json out.json

Prints a table and writes benchmarks/results/explain_search.json (with the machine and its load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.comparison.explain import api, hypotheses  # noqa: E402
from mixprec.comparison.explain.capture import Capture  # noqa: E402
from mixprec.comparison.explain.search import IslandSearch, Tree  # noqa: E402
from mixprec.instruments.machine import describe, environment  # noqa: E402
from mixprec.tasks import Task  # noqa: E402


class Standardize(nn.Module):
    """The plant: (x - mean) / std with the variance as E[x^2] - E[x]^2, in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-4)


class Block(nn.Module):
    def __init__(self, width: int, planted: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        with torch.no_grad():
            self.fc.bias.fill_(8.0 if planted else 0.0)
            self.fc.weight.mul_(0.5)
        self.norm = Standardize() if planted else nn.LayerNorm(width, elementwise_affine=False)
        self.act = nn.Tanh()
        self.gain = 4.0 if planted else 1.0  # the planted branch weighs more: a clear divergence at every depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.act(self.norm(self.fc(x)))


def make_task(depth: int, width: int = 16, steps: int = 60) -> tuple[Task, str]:
    planted = depth // 2

    def build() -> nn.Module:
        blocks = [Block(width, i == planted) for i in range(depth)]
        return nn.Sequential(nn.Linear(16, width), *blocks, nn.Linear(width, 4))

    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) / 4

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(10_000 + step))
        return x, torch.tanh(2 * x @ teacher)

    task = Task(f"planted-depth-{depth}", build, batch, nn.functional.mse_loss,
                build_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), steps=steps, max_grad_norm=1.0)
    return task, f"{planted + 1}.norm"


def run(depth: int, mode: str) -> dict:
    task, culprit = make_task(depth)
    saved_tree, saved_entry = hypotheses.search_tree, Capture.entry_points
    if mode == "unranked":
        def reverse(cap):  # the culprit last among its siblings, at every level
            return {k: list(reversed(v)) for k, v in saved_tree(cap).items()}
        api.search_tree = reverse
        Capture.entry_points = lambda self, factor=16.0: []  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        e = mixprec.explain(task, "bf16-mixed", device="cpu", threads=1)
        wall = time.perf_counter() - t0
    finally:
        api.search_tree, Capture.entry_points = saved_tree, saved_entry
    tree = hypotheses.search_tree(e.capture) if e.capture is not None else {}
    searched = len(set(tree) | {c for v in tree.values() for c in v})
    return {"depth": depth, "mode": mode, "modules": e.module_count, "searched": searched,
            "status": e.status, "verdict": e.verdict.status, "culprits": e.culprits, "expected": culprit,
            "found": e.culprits == [culprit], "fix": e.fix.code if e.fix else None,
            "search_runs": e.search_runs, "runs": e.runs, "steps_trained": e.steps_trained,
            "horizon": e.horizon, "wall_s": round(wall, 2)}


def oracle_rows() -> list[dict]:
    """The search against an exact oracle on balanced trees (see the module doc)."""
    import random

    rows = []
    for branching, leaves in ((2, 8), (2, 64), (2, 1024), (4, 16), (4, 256), (8, 64), (8, 4096)):
        children, level = {}, [""]
        while len(level) < leaves:
            nxt = []
            for node in level:
                children[node] = [f"{node}.{i}".lstrip(".") for i in range(branching)]
                nxt += children[node]
            level = nxt
        culprit = level[len(level) // 3]
        modules = len(set(children) | {c for v in children.values() for c in v})
        row = {"branching": branching, "modules": modules}
        for how in ("good", "bad", "random"):
            rng = random.Random(0)
            ranked = {}
            for node, kids in children.items():
                bad = [k for k in kids if culprit == k or culprit.startswith(k + ".")]
                rest = [k for k in kids if k not in bad]
                ranked[node] = bad + rest if how == "good" else rest + bad if how == "bad" else rng.sample(kids, len(kids))
            search = IslandSearch(Tree(ranked), lambda sets: [any(culprit == x or culprit.startswith(x + ".") or x == ""
                                                                  for x in s) for s in sets])
            assert search.run() == [culprit]
            row[how] = search.log.runs
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 5, 10, 21])
    ap.add_argument("--json", default=str(pathlib.Path(__file__).parent / "results" / "explain_search.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = [run(d, m) for d in args.depths for m in ("ranked", "unranked")]
    print(f"{'depth':>5} {'modules':>7} {'searched':>8} {'log2':>5} {'mode':>9} {'search runs':>11} {'all runs':>8} "
          f"{'found':>5} {'wall s':>7}")
    for r in rows:
        print(f"{r['depth']:>5} {r['modules']:>7} {r['searched']:>8} {math.log2(max(r['searched'], 1)):>5.1f} {r['mode']:>9} "
              f"{r['search_runs']:>11} {r['runs']:>8} {str(r['found']):>5} {r['wall_s']:>7.1f}")
    sim = oracle_rows()
    print("\nthe search alone, exact oracle (runs; culprit ranked first / last / at random):")
    print(f"{'branching':>9} {'modules':>7} {'log2':>5} {'good':>5} {'bad':>5} {'random':>6}")
    for r in sim:
        print(f"{r['branching']:>9} {r['modules']:>7} {math.log2(r['modules']):>5.1f} {r['good']:>5} {r['bad']:>5} "
              f"{r['random']:>6}")
    env = environment("cpu")
    print(f"machine: {describe(env)}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    out = {"benchmark": "explain_search", "machine": env, "load_before": load, "load_after": os.getloadavg(),
           "rows": rows, "oracle": sim}
    pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0 if all(r["found"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
