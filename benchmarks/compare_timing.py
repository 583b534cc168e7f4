"""How much compare's speed column moves between repeats of the same command: sequential vs interleaved.

Runs ``mixprec.compare`` on the built-in task ``--repeats`` times with the speed taken from the
runs themselves (``timing_rounds=0``: one run after another) and as many times with interleaved
timing rounds (the default), alternating, and reports for each recipe the speedups every repeat
gave and their spread (max / min). The machine load (``uptime``) is recorded before and after.

    python benchmarks/compare_timing.py                       # 3 repeats each, 60 steps
    python benchmarks/compare_timing.py --repeats 5 --steps 200 --json benchmarks/results/compare_timing.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timing-rounds", type=int, default=10)
    p.add_argument("--recipes", nargs="+", default=["bf16-mixed", "fp16-mixed"])
    p.add_argument("--json", default=str(RESULTS / "compare_timing.json"), help="where the results go ('' for none)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mixprec.comparison.api import compare
    from mixprec.instruments.machine import environment

    before = uptime()
    print(f"load before: {before}", file=sys.stderr)
    got: dict[str, dict[str, list[float]]] = {"sequential": {}, "interleaved": {}}
    intervals: dict[str, list] = {}
    for i in range(args.repeats):
        for method, rounds in (("sequential", 0), ("interleaved", args.timing_rounds)):
            r = compare(recipes=args.recipes, steps=args.steps, device="cpu", threads=1, timing_rounds=rounds)
            for name in args.recipes:
                got[method].setdefault(name, []).append(r.speedup(name))
                if method == "interleaved":
                    intervals.setdefault(name, []).append(r.speed_interval(name))
            print(f"repeat {i + 1}/{args.repeats} {method}: " + ", ".join(
                f"{n} {got[method][n][-1]:.3f}" for n in args.recipes), file=sys.stderr)
    out = {"machine": environment("cpu"), "uptime_before": before, "uptime_after": uptime(), "args": vars(args),
           "speedups": got, "intervals": intervals,
           "spread": {m: {n: max(v) / min(v) for n, v in d.items()} for m, d in got.items()}}
    print(f"\ncompare on the built-in task, {args.steps} steps, {args.repeats} repeats of each method, 1 thread")
    print("| recipe | method | speedup per repeat | max / min |\n|---|---|---|---|")
    for name in args.recipes:
        for method in ("sequential", "interleaved"):
            v = got[method][name]
            print(f"| {name} | {method} | {', '.join(f'{x:.3f}' for x in v)} | {max(v) / min(v):.3f} |")
    print(f"load after: {out['uptime_after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
