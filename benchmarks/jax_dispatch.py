"""What a jitted call costs on the host for each form of the optimizer state (issue 32.3): the same leaves in
mixprec's ``SkipNonFiniteState`` (with its ``DynamicLossScale``), with the scale's leaves as a plain tuple, with
them in a minimal Python-registered pytree node, and the hand-written step's dict. The function is an identity
(parameters and state in, the same out), so the compiled program does nothing and the time is jax's argument
flattening, cache lookup, buffer handling and result rebuilding. Forms interleaved round by round.

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 python benchmarks/jax_dispatch.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_step_overhead as steps  # noqa: E402  (puts this checkout's src/ on sys.path)


class _Leaves:
    """Two leaves in a Python-registered pytree node with no aux data: the cheapest such node."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(_Leaves, lambda n: ((n.a, n.b), None), lambda _, c: _Leaves(*c))


def states(recipe, params, x, y):
    out = {}
    for name, (step, init) in {"mixprec": steps.make_mixprec(recipe), "hand+count": steps.make_hand(recipe, count=True)}.items():
        out[name] = step(params, init(params), x, y)[1]  # after one step: device arrays, as in training
    s = out["mixprec"]
    ls = s.loss_scale
    leaves = tuple(jax.tree_util.tree_leaves(ls))
    return {
        "mixprec's state": s,
        "its scale's leaves as a tuple": s._replace(loss_scale=leaves),
        "its scale's leaves in a minimal Python node": s._replace(loss_scale=_Leaves(*leaves)) if len(leaves) == 2 else None,
        "hand-written dict with the skip record": out["hand+count"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["bf16-mixed", "fp16-mixed"])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--calls", type=int, default=50, help="calls per form per round")
    args = ap.parse_args(argv)
    steps.DIMS[:] = [64, 128, 128, 10]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 64), jnp.int32)
    params = steps.init_params(jax.random.PRNGKey(0))
    from mixprec.instruments.machine import cpu_name

    print(f"{cpu_name()}, jax {jax.__version__}, MLP {tuple(steps.DIMS)}, {args.rounds} rounds x {args.calls} calls")
    f = jax.jit(lambda p, s: (p, s))
    for recipe in args.recipes:
        forms = {k: v for k, v in states(recipe, params, x, y).items() if v is not None}
        for s in forms.values():
            jax.block_until_ready(f(params, s))
        us = {k: [] for k in forms}
        for _ in range(args.rounds):
            for k, s in forms.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    out = f(params, s)
                jax.block_until_ready(out)
                us[k].append((time.perf_counter() - t0) / args.calls * 1e6)
        print(f"\n{recipe}:")
        for k, t in us.items():
            print(f"  {k}: {np.median(t):.1f} us per call, {len(jax.tree_util.tree_leaves(forms[k]))} leaves")


if __name__ == "__main__":
    main()
