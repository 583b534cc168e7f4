"""What XLA's excess precision off costs a bf16 train step on CPU: the built-in JAX compare task's bf16-mixed step
(mixprec.jax.comparison.make_step) compiled with XLA's default options and with
``xla_allow_excess_precision=False`` (what ``compare --backend jax`` uses), interleaved rounds, ratio per round with
a 95% bootstrap interval of the median (docs/jax.md, "Excess precision").

    python benchmarks/jax_excess_precision.py --json benchmarks/results/jax_excess_precision_m2.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mixprec.jax.comparison as C  # noqa: E402
from mixprec.jax.recipes import get_recipe  # noqa: E402
from mixprec.jax.tasks import _batch, make_task  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="bf16-mixed")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load = os.getloadavg()
    task, recipe = make_task(), get_recipe(args.recipe)
    strict = dict(C.COMPILER_OPTIONS)
    arms = {}
    for name, options in (("default", {}), ("excess-precision-off", strict)):
        C.COMPILER_OPTIONS = options  # make_step reads it when it builds the jitted step
        prepared = C.make_step(task, recipe)
        params = recipe.prepare_params(task.init_params(jax.random.PRNGKey(0)))
        x, y = (jnp.asarray(a) for a in _batch(task, 0))
        state = prepared.init(params)
        jax.block_until_ready(prepared.step(params, state, x, y))
        arms[name] = (prepared.step, params, state, x, y)
    C.COMPILER_OPTIONS = strict
    times = {k: [] for k in arms}
    order = list(arms)
    for r in range(args.rounds):
        for name in order[r % 2:] + order[: r % 2]:
            step, params, state, x, y = arms[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = step(params, state, x, y)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
    ratio = np.array(times["excess-precision-off"]) / np.array(times["default"])
    rng = np.random.default_rng(0)
    meds = np.median(rng.choice(ratio, (2000, len(ratio))), axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    from mixprec.instruments.machine import cpu_name

    print(f"{cpu_name()}, jax {jax.__version__}, load {load[0]:.2f}; {task.description}, {args.recipe}, "
          f"{args.rounds} rounds x {args.steps} steps")
    for name, t in times.items():
        print(f"  {name:22s} {np.median(t) * 1e3:.3f} ms per step")
    print(f"  excess precision off / default: {np.median(ratio):.3f} [{lo:.3f}-{hi:.3f}]")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "env": {"cpu": cpu_name(), "jax": jax.__version__, "load_before": load, "load_after": os.getloadavg(),
                    "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")},
            "ms": {n: float(np.median(t) * 1e3) for n, t in times.items()},
            "ratio_off_over_default": {"median": float(np.median(ratio)), "ci95": [float(lo), float(hi)]},
        }, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
