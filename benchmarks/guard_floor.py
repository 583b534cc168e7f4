"""What the full trace's machinery costs before the guard does anything: the floor under issue 32.1.

Two measurements, one command:

1. On the tiny Hugging Face GPT-2 (as ``guard_overhead.py`` builds it), the unguarded step against the
   same step under a ``TorchFunctionMode`` whose handler only calls the function, and against the step
   with an empty forward pre- and post-hook on every module. Interleaved rounds (the order rotated
   each round), ratio per round: median and 95% bootstrap interval.
2. Per op, on a chain of ``torch.mul`` calls on a 64-element tensor outside any module
   (``Tracer(outside_modules=True, lazy=True)``): the forward, the backward and the read at the check,
   without the tracer and with it (full; without source lines; without the backward hooks).

    python benchmarks/guard_floor.py
    python benchmarks/guard_floor.py --rounds 60 --ops 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from mixprec.instruments.timing import interleaved_order, paired_ratio  # noqa: E402


class _EmptyMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _ratio(numer: list[float], denom: list[float]) -> str:
    r = paired_ratio(numer, denom)
    return f"{r['median']:.3f} ({r['ci95_low']:.3f}-{r['ci95_high']:.3f})"


def model_floor(rounds: int) -> None:
    import guard_overhead
    import mixprec

    task = guard_overhead.hf_task("gpt2", 4, 32, 64, 2)

    def arm(kind: str):
        torch.manual_seed(0)
        mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard=False)
        model = mp.prepare(task.build_model())
        opt = torch.optim.AdamW(mp.parameters(model), lr=1e-4)
        x, y = task.get_batch(0)
        if kind == "module-hooks":
            for m in model.modules():
                m.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
                m.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)

        def step():
            if kind == "empty-mode":
                with _EmptyMode(), mp.autocast():
                    out = task.run_forward(model, x)
            else:
                with mp.autocast():
                    out = task.run_forward(model, x)
            mp.step(task.loss_fn(out, y), opt)
        return step

    arms = {k: arm(k) for k in ("off", "empty-mode", "module-hooks")}
    for f in arms.values():
        for _ in range(5):
            f()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _, k in interleaved_order(list(arms), rounds):
        t = time.perf_counter()
        arms[k]()
        times[k].append(time.perf_counter() - t)
    print(f"tiny GPT-2, fp32, 1 thread, {rounds} interleaved rounds; unguarded step {statistics.median(times['off']) * 1e3:.2f} ms")
    print("| arm | step / unguarded |\n|---|---|")
    for k in ("empty-mode", "module-hooks"):
        print(f"| {k} | {_ratio(times[k], times['off'])} |")


def per_op(n_ops: int, reps: int = 30) -> None:
    from mixprec.diagnostics._trace import Tracer

    def chain(tracer: Tracer | None) -> tuple[float, float, float]:
        x = torch.randn(64, requires_grad=True)
        got = []
        for _ in range(reps):
            if tracer is not None:
                tracer.enter_scope()
            t0 = time.perf_counter()
            y = x
            for _ in range(n_ops):
                y = torch.mul(y, 1.0001)
            t1 = time.perf_counter()
            if tracer is not None:
                tracer.exit_scope()
            y.sum().backward()
            t2 = time.perf_counter()
            if tracer is not None:
                tracer.take()
            t3 = time.perf_counter()
            got.append(((t1 - t0) / n_ops * 1e6, (t2 - t1) / n_ops * 1e6, (t3 - t2) / n_ops * 1e6))
        got.sort()
        return got[len(got) // 2]

    print(f"\nper op: a chain of {n_ops} torch.mul on 64 elements, median of {reps}")
    print("| tracer | forward us/op | backward us/op | read us/op |\n|---|---|---|---|")
    rows = [("none", None)] + [(label, kw) for label, kw in (
        ("full", {}), ("no source lines", {"locate_ops": False}), ("no backward hooks", {"backward": False}),
        ("neither", {"backward": False, "locate_ops": False}))]
    for label, kw in rows:
        tracer = None if kw is None else Tracer(nn.Linear(2, 2), lazy=True, outside_modules=True, **kw).attach()
        f, b, r = chain(tracer)
        if tracer is not None:
            tracer.detach()
        print(f"| {label} | {f:.2f} | {b:.2f} | {r:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--ops", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model_floor(args.rounds)
    per_op(args.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
