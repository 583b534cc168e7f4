"""What the parts of the guard's backward trace cost: the full trace (``trace="every-step"``) on a tiny
Hugging Face GPT-2 against the unguarded step, with one part of the tracer switched off in-process.

This replaces tracer internals (a measurement aid, never the library's behaviour), so the guard
it runs is no longer a working guard. Variants:

- ``as-is``: the full trace;
- ``hook-body-empty``: the autograd-node hooks fire, and do nothing;
- ``no-grad-records``: the hooks run, without recording the gradients;
- ``no-screen``: no finiteness screen of the recorded tensors at the check (forward and backward);
- ``no-hooks``: the nodes are marked, no hook is registered.

Each variant runs in its own process (the switch is a monkeypatch), ``--rounds`` interleaved
rounds of one step per arm; the ratio is per round, median with the 6th-lowest and 6th-highest of
40 as the bounds.

    python benchmarks/guard_parts.py                       # every variant, 40 rounds
    python benchmarks/guard_parts.py --variants as-is no-hooks --rounds 60
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("as-is", "hook-body-empty", "no-grad-records", "no-screen", "no-hooks")


def _switch(variant: str) -> None:
    from mixprec.diagnostics import _stats as S
    from mixprec.diagnostics import _trace as T

    if variant == "hook-body-empty":
        T.Tracer._on_node = lambda self, info, gi, go: None
    elif variant == "no-grad-records":
        T.Tracer._measure_grads = lambda self, info, gi, go: ((), (None,))
    elif variant == "no-screen":
        S._screen = lambda ts: [True] * len(ts)
    elif variant == "no-hooks":
        class _NoHook:  # the node is walked and marked as adopt does; register_hook is not called
            def __init__(self, node):
                self.node = node

        def adopt(self, node, call, op, where, route=False):
            todo = [node]
            while todo:
                n = todo.pop()
                if n is None:
                    continue
                c = T._NODE_CLASSES.get(type(n)) or T._node_class(n)
                if c[0] == T._ACCUMULATE:
                    continue
                meta = n.metadata
                mark = meta.get(self._key)
                if mark is not None:
                    if n is not node:
                        mark.consumed = True
                    continue
                meta[self._key] = T._NodeInfo(self._token, call, op, c[1], where)
                for f, _ in n.next_functions:
                    todo.append(f)

        T.Tracer.adopt = adopt


def _one(variant: str, rounds: int) -> str:
    sys.path.insert(0, str(HERE.parent / "src"))
    sys.path.insert(0, str(HERE))
    import torch

    import guard_overhead
    import mixprec

    torch.set_num_threads(1)
    _switch(variant)
    task = guard_overhead.hf_task("gpt2", 4, 32, 64, 2)

    def arm(flag):
        torch.manual_seed(0)
        mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard=flag)
        model = mp.prepare(task.build_model())
        opt = torch.optim.AdamW(mp.parameters(model), lr=1e-4)
        x, y = task.get_batch(0)

        def step():
            with mp.autocast():
                out = task.run_forward(model, x)
            mp.step(task.loss_fn(out, y), opt)
        return step

    arms = {"off": arm(False), "on": arm({"mode": "raise", "trace": "every-step"})}
    for f in arms.values():
        for _ in range(5):
            f()
    times = {k: [] for k in arms}
    for _ in range(rounds):
        for k, f in arms.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    r = sorted(a / b for a, b in zip(times["on"], times["off"]))
    k = max(0, len(r) * 6 // 40 - 1)
    return (f"| {variant} | {statistics.median(r):.3f} ({r[k]:.3f}-{r[-1 - k]:.3f}) | "
            f"{statistics.median(times['off']) * 1e3:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.one:
        print(_one(args.one, args.rounds))
        return 0
    print("| variant | every-step / off | off ms |\n|---|---|---|")
    for v in args.variants:
        out = subprocess.run([sys.executable, __file__, "--one", v, "--rounds", str(args.rounds)],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
