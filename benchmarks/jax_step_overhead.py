"""A jitted JAX train step through mixprec.jax (policy casts + skip_nonfinite) against the same step written
by hand, on a small MLP: run time after compile (interleaved rounds, ratio per round, 95% bootstrap interval of
the median), compile time, and the ops each adds (jaxpr equations by primitive, optimized HLO instructions by
opcode). Issue 32's goal: <= 1.02x after compile.

The hand-written twins do what the mixprec step does, no more:

- fp16-mixed: cast params and inputs to f16, scale the loss, grad, unscale by the reciprocal, an all-finite
  check, AdamW, keep the old params and state where not finite, the dynamic scale's update (jmp's rule);
- bf16-mixed: cast, grad, AdamW, and the same all-finite check and keep (skip_nonfinite skips non-finite steps
  whatever the recipe); ``--bf16-unchecked`` adds the bare step without the check, for reference.

``--hand-count`` adds a third twin: the hand-written step plus the skip record mixprec keeps (an int32[2]
state leaf, ``[skipped so far, last step skipped]``), so the ratio against it is the price of the policy and
the loss scale alone, the record being a feature the plain twin lacks.

    python benchmarks/jax_step_overhead.py                       # both recipes, 15 rounds of 20 steps
    python benchmarks/jax_step_overhead.py --rounds 30 --json benchmarks/results/jax_step_overhead_m2.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402

DIMS = [256, 512, 512, 512, 10]


def init_params(key):
    params = {}
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        key, k = jax.random.split(key)
        params[f"l{i}"] = {"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a), "b": jnp.zeros((b,), jnp.float32)}
    return params


def forward(params, x):
    h = x
    for i in range(len(DIMS) - 1):
        layer = params[f"l{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < len(DIMS) - 2:
            h = jax.nn.relu(h)
    return h


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_mixprec(recipe):
    r = mpj.get_recipe(recipe)
    policy, tx = r.policy, mpj.skip_nonfinite(optax.adamw(1e-3), recipe)

    @jax.jit
    def step(params, opt_state, x, y):
        ls = mpj.loss_scale_of(opt_state)

        def loss_fn(p):
            pc, xc = policy.cast_to_compute((p, x))
            return ls.scale(loss_of(policy.cast_to_output(forward(pc, xc)), y))

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init


def make_hand(recipe, checked=True, count=False):
    dtype = jnp.float16 if recipe == "fp16-mixed" else jnp.bfloat16
    scaled = recipe == "fp16-mixed"
    opt = optax.adamw(1e-3)

    def init(params):
        state = {"opt": opt.init(params)}
        if scaled:
            state.update(scale=jnp.float32(2.0**16), counter=jnp.int32(0))
        if count:
            state["skips"] = jnp.zeros([2], jnp.int32)
        return state

    @jax.jit
    def step(params, state, x, y):
        scale = state["scale"] if scaled else None

        def loss_fn(p):
            pc = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)
            loss = loss_of(forward(pc, x.astype(dtype)).astype(jnp.float32), y)
            return loss * scale if scaled else loss

        grads = jax.grad(loss_fn)(params)
        if scaled:
            inv = 1 / scale
            grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
        updates, new_opt = opt.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        if not checked:
            return new_params, {"opt": new_opt}
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = {"opt": keep(new_opt, state["opt"])}
        if scaled:  # jmp's DynamicLossScale rule: period 2000, factor 2, floor 1
            grow = state["counter"] == 1999
            new_state["scale"] = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(1.0, scale / 2))
            new_state["counter"] = jnp.where(finite, (state["counter"] + 1) % 2000, 0)
        if count:  # skip_nonfinite's record, written the same way: [count + s, s]
            new_state["skips"] = state["skips"] * jnp.array([1, 0], jnp.int32) + (~finite).astype(jnp.int32)
        return keep(new_params, params), new_state

    return step, init


_HLO_OP = __import__("re").compile(r"\s*(?:ROOT\s+)?%\S+\s*=\s*(?:\([^=]*?\)|\S+)\s+([\w-]+)\(")


def _counts(step, args):
    jaxpr = jax.make_jaxpr(step)(*args)

    def walk(j, c):
        for e in j.eqns:
            c[e.primitive.name] += 1
            for v in e.params.values():
                sub = getattr(v, "jaxpr", None)
                if sub is not None and hasattr(sub, "eqns"):
                    walk(sub, c)
        return c

    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    hlo = Counter()
    for line in compiled.as_text().splitlines():
        m = _HLO_OP.match(line)
        if m:
            hlo[m.group(1)] += 1
    return walk(jaxpr.jaxpr, Counter()), hlo, compile_s


def _ci(ratios, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(ratios, (n, len(ratios))), axis=1)
    return float(np.median(ratios)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["bf16-mixed", "fp16-mixed"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="steps per arm per round")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dims", type=int, nargs="+", default=DIMS, help="the MLP's widths, input to output")
    ap.add_argument("--bf16-unchecked", action="store_true", help="also time bf16 without the finiteness check")
    ap.add_argument("--hand-count", action="store_true",
                    help="also time the hand-written step with mixprec's skip record (skipped count, last-skipped flag)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    DIMS[:] = args.dims
    load = os.getloadavg()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.batch, DIMS[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, DIMS[-1], args.batch), jnp.int32)
    params = init_params(jax.random.PRNGKey(0))
    from mixprec.instruments.machine import cpu_name

    print(f"{cpu_name()}, jax {jax.__version__} ({jax.default_backend()}), load {load[0]:.2f}, MLP {tuple(DIMS)}, "
          f"batch {args.batch}, {args.rounds} rounds x {args.steps} steps, interleaved")
    results = {}
    for recipe in args.recipes:
        arms = {"mixprec": make_mixprec(recipe), "hand": make_hand(recipe)}
        if args.bf16_unchecked and recipe == "bf16-mixed":
            arms["hand-unchecked"] = make_hand(recipe, checked=False)
        if args.hand_count:
            arms["hand+count"] = make_hand(recipe, count=True)
        state = {}
        info = {}
        for name, (step, init) in arms.items():
            s = (params, init(params))
            ops, hlo, compile_s = _counts(step, (*s, x, y))
            info[name] = {"jaxpr": ops, "hlo": hlo, "compile_s": compile_s}
            s = step(*s, x, y)
            jax.block_until_ready(s)
            state[name] = s
        times = {n: [] for n in arms}
        order = list(arms)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                step = arms[name][0]
                s = state[name]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    s = step(*s, x, y)
                jax.block_until_ready(s)
                times[name].append((time.perf_counter() - t0) / args.steps)
                state[name] = s
        med, lo, hi = _ci(np.array(times["mixprec"]) / np.array(times["hand"]))
        extra_jaxpr = {k: v for k, v in (info["mixprec"]["jaxpr"] - info["hand"]["jaxpr"]).items()}
        fewer_jaxpr = {k: v for k, v in (info["hand"]["jaxpr"] - info["mixprec"]["jaxpr"]).items()}
        extra_hlo = {k: v for k, v in (info["mixprec"]["hlo"] - info["hand"]["hlo"]).items()}
        fewer_hlo = {k: v for k, v in (info["hand"]["hlo"] - info["mixprec"]["hlo"]).items()}
        results[recipe] = {
            "ms": {n: float(np.median(t) * 1e3) for n, t in times.items()},
            "ratio_mixprec_over_hand": {"median": med, "ci95": [lo, hi]},
            "compile_s": {n: i["compile_s"] for n, i in info.items()},
            "jaxpr_eqns": {n: sum(i["jaxpr"].values()) for n, i in info.items()},
            "hlo_instructions": {n: sum(i["hlo"].values()) for n, i in info.items()},
            "jaxpr_extra": extra_jaxpr, "jaxpr_fewer": fewer_jaxpr, "hlo_extra": extra_hlo, "hlo_fewer": fewer_hlo,
        }
        for twin, key in (("hand-unchecked", "ratio_mixprec_over_unchecked"), ("hand+count", "ratio_mixprec_over_hand_count")):
            if twin in times:
                m, a, b = _ci(np.array(times["mixprec"]) / np.array(times[twin]))
                results[recipe][key] = {"median": m, "ci95": [a, b]}
        if "hand+count" in times:  # signed: what mixprec's program has more (or fewer) of than the twin's
            diff = Counter(info["mixprec"]["hlo"])
            diff.subtract(info["hand+count"]["hlo"])
            results[recipe]["hlo_extra_over_hand_count"] = {k: v for k, v in sorted(diff.items()) if v}
        ms = results[recipe]["ms"]
        print(f"\n{recipe}: mixprec {ms['mixprec']:.3f} ms, hand {ms['hand']:.3f} ms per step; "
              f"ratio {med:.3f} [{lo:.3f}-{hi:.3f}]; compile {info['mixprec']['compile_s']:.2f} s vs "
              f"{info['hand']['compile_s']:.2f} s")
        if "ratio_mixprec_over_unchecked" in results[recipe]:
            u = results[recipe]["ratio_mixprec_over_unchecked"]
            print(f"  against the step without a finiteness check: {u['median']:.3f} [{u['ci95'][0]:.3f}-{u['ci95'][1]:.3f}]")
        if "ratio_mixprec_over_hand_count" in results[recipe]:
            c = results[recipe]["ratio_mixprec_over_hand_count"]
            print(f"  against the hand-written step with the same skip record: {c['median']:.3f} "
                  f"[{c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}]; optimized HLO instructions mixprec minus it: "
                  f"{results[recipe]['hlo_extra_over_hand_count'] or 'none'}")
        print(f"  jaxpr equations {results[recipe]['jaxpr_eqns']}; extra {extra_jaxpr or '-'}; fewer {fewer_jaxpr or '-'}")
        print(f"  optimized HLO instructions {results[recipe]['hlo_instructions']}; extra {extra_hlo or '-'}; "
              f"fewer {fewer_hlo or '-'}")
    if args.json:
        env = {"cpu": cpu_name(), "jax": jax.__version__, "backend": jax.default_backend(), "python": platform.python_version(),
               "load_before": load, "load_after": os.getloadavg(), "command": " ".join(sys.argv),
               "date": time.strftime("%Y-%m-%d"),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
        pathlib.Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
