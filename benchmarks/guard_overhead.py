"""What the NaN guard costs: step time with ``MixedPrecision(nan_guard=True)`` relative to off.

Two identical models (same seed) train on the built-in task; their steps are interleaved
(off, on, off, on, ...) so load from other processes hits both alike. Prints the median step time
of each, the ratio (the target is under 1.5x), and the hooks each model carries: exactly zero
when the guard is off (for recipes that add none themselves, such as fp32).

    python benchmarks/guard_overhead.py                     # fp32 on the CPU
    python benchmarks/guard_overhead.py --recipe bf16-mixed --device cuda --steps 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mixprec
from mixprec.diagnostics._trace import hook_count
from mixprec.tasks import load_task, to_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(ops=...): watch each torch call, not only module outputs")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(backward=...): watch the gradients through each autograd node")
    p.add_argument("--locate", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(locate=...): note each op's source line")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    task = load_task(None, batch_size=args.batch_size, seq_len=args.seq_len)

    sides = {}
    for guarded in (False, True):
        torch.manual_seed(0)
        model = task.build_model().to(device)
        guard = {"mode": "raise", "ops": args.ops, "backward": args.backward, "locate": args.locate}
        mp = mixprec.MixedPrecision(args.recipe, device, nan_guard=guard if guarded else False)
        mp.prepare(model)
        sides[guarded] = (model, mp, task.build_optimizer(model.parameters()), [])

    def step(guarded: bool, i: int) -> float:
        model, mp, opt, _ = sides[guarded]
        inputs, targets = to_device(task.get_batch(i), device)
        _sync(device)
        t0 = time.perf_counter()
        with mp.autocast():
            loss = task.loss_fn(task.run_forward(model, inputs), targets)
        mp.step(loss, opt, max_grad_norm=task.max_grad_norm)
        _sync(device)
        return time.perf_counter() - t0

    for i in range(args.warmup + args.steps):
        for guarded in (False, True):
            dt = step(guarded, i)
            if i >= args.warmup:
                sides[guarded][3].append(dt)
    off = statistics.median(sides[False][3])
    on = statistics.median(sides[True][3])
    result = {
        "recipe": mixprec.resolve_recipe(args.recipe, device).name, "device": str(device),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
        "guard_options": {"ops": args.ops, "backward": args.backward, "locate": args.locate},
        "steps": args.steps, "off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": on / off,
        "hooks_off": hook_count(sides[False][0]), "hooks_on": hook_count(sides[True][0]),
        "guard_checks": sides[True][1].guard.checks, "guard_events": len(sides[True][1].guard.events),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"built-in task, recipe {result['recipe']} on {device}, B={args.batch_size} T={args.seq_len}, "
              f"{result['threads']} thread(s), median of {args.steps} interleaved steps")
        print(f"  guard off: {off * 1e3:8.2f} ms/step   hooks on the model: {result['hooks_off']}")
        opts = ", ".join(f"{k}={v}" for k, v in result["guard_options"].items())
        print(f"  guard on:  {on * 1e3:8.2f} ms/step   ({opts})")
        print(f"             hooks on the model: {result['hooks_on']}   "
              f"checks: {result['guard_checks']} (host syncs), events: {result['guard_events']}")
        print(f"  ratio on/off: {result['ratio']:.2f}x  (target < 1.5x)")
    return result


if __name__ == "__main__":
    main()
