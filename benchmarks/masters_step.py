"""What the master-weight strategies cost per step: on a model of many small tensors, or on the block.

The storage recipes add work around the optimizer step: 16-bit gradients folded into fp32, the
fp32 values rebuilt (compact strategies) and written back into 16 bits. On a model of many small
tensors (``--model mlp``, the default: 150 Linear(32, 32) layers = 300 tensors) the per-tensor
Python shows; on the reference transformer block (``--model block``: ``mixprec bench``'s cpu
shape, d=256, compute-bound) the arithmetic per element does. Every recipe trains its own copy of
the same model; rounds interleave the recipes (the order rotated each round) and the ratios
against bf16-mixed and bf16-true are formed per round.

Reports per recipe: median step time, step time / bf16-mixed and / bf16-true (median of
per-round ratios, with a 95% bootstrap interval), and the strategy's own time per step
(``after_backward`` + ``after_step`` + the rebuild and write-back of a step run a bucket at a time,
without the optimizer's own time), per tensor and per byte of 16-bit parameter. The machine load
(``uptime``) is recorded before and after.

    python benchmarks/masters_step.py                        # CPU, 1 thread, defaults
    python benchmarks/masters_step.py --model block --rounds 20 --json benchmarks/results/masters_block.json
    python benchmarks/masters_step.py --layers 400 --width 16 --rounds 40
    python benchmarks/masters_step.py --src ../old-checkout/src   # time another mixprec (before/after)
    python benchmarks/masters_step.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RECIPES = ["bf16-mixed", "bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="mlp", choices=("mlp", "block"),
                    help="mlp: many small Linear layers; block: the reference transformer block (cpu shape)")
    ap.add_argument("--layers", type=int, default=150, help="Linear layers (2 tensors each; default 150)")
    ap.add_argument("--width", type=int, default=32, help="their width (default 32)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--recipes", nargs="+", default=RECIPES, help="bf16-mixed is the baseline and always runs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    ap.add_argument("--src", help="import mixprec from this src/ directory instead of this checkout's")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    src = Path(args.src).resolve() if args.src else Path(__file__).resolve().parents[1] / "src"
    sys.path.insert(0, str(src))
    import torch
    from torch import nn

    import mixprec
    from mixprec.instruments.timing import Summary, interleaved_order, paired_ratio, synchronize

    if not Path(mixprec.__file__).resolve().is_relative_to(src):
        ap.error(f"imported mixprec from {mixprec.__file__}, not from {src}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    recipes = ["bf16-mixed"] + [r for r in args.recipes if r != "bf16-mixed"]

    if "bf16-true" not in recipes:
        recipes.insert(1, "bf16-true")
    if args.model == "block":
        from mixprec.bench.block import RefBlock, get_shape, make_batches
        from mixprec.bench.block import loss_fn as block_loss

        shape = get_shape("cpu")

    class Run:
        def __init__(self, recipe: str) -> None:
            torch.manual_seed(0)
            if args.model == "block":
                model = RefBlock(shape).to(device)
                self.x, self.y = make_batches(shape, device, count=1)[0]
            else:
                model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(device)
                g = torch.Generator().manual_seed(1)
                self.x = torch.randn(args.batch, args.width, generator=g).to(device)
            self.mp = mixprec.MixedPrecision(recipe, device)
            self.model = self.mp.prepare(model)
            self.opt = torch.optim.AdamW(self.mp.parameters(self.model), lr=1e-4, foreach=True)
            self.own = 0.0  # seconds inside the strategy's hooks
            m = self.mp.masters
            self.tensors = len(m.slots) if m is not None else 0
            self.bytes16 = sum(s.param.numel() * s.param.element_size() for s in m.slots) if m is not None else 0
            if m is not None:  # time the strategy's two hooks (host time; synced on CUDA)
                for name in ("after_backward", "after_step"):
                    inner = getattr(m, name)

                    def timed(*a, _inner=inner, **k):
                        synchronize(device)
                        t0 = time.perf_counter()
                        _inner(*a, **k)
                        synchronize(device)
                        self.own += time.perf_counter() - t0

                    setattr(m, name, timed)
                if hasattr(m, "_step_bucket"):  # a bucketed step rebuilds and writes back in here
                    inner_bucket = m._step_bucket

                    def timed_bucket(b, opt, groups, step, a, k, _inner=inner_bucket):
                        def opt_step(*sa, **sk):  # the optimizer's time is not the strategy's
                            synchronize(device)
                            t1 = time.perf_counter()
                            out = step(*sa, **sk)
                            synchronize(device)
                            self.own -= time.perf_counter() - t1
                            return out

                        synchronize(device)
                        t0 = time.perf_counter()
                        out = _inner(b, opt, groups, opt_step, a, k)
                        synchronize(device)
                        self.own += time.perf_counter() - t0
                        return out

                    m._step_bucket = timed_bucket

        def step(self) -> None:
            with self.mp.autocast():
                out = self.model(self.x)
                loss = block_loss(out, self.y) if args.model == "block" else out.float().pow(2).mean()
            self.mp.step(loss, self.opt, max_grad_norm=1.0)

    load_before = uptime()
    runs = {r: Run(r) for r in recipes}
    for run in runs.values():  # warm-up: optimizer state, allocator
        for _ in range(3):
            run.step()
        run.own = 0.0
    times: dict[str, list[float]] = {r: [] for r in recipes}
    for i, (rnd, r) in enumerate(interleaved_order(recipes, args.rounds)):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps_per_round):
            runs[r].step()
        synchronize(device)
        times[r].append((time.perf_counter() - t0) / args.steps_per_round)
        if r == recipes[-1] and (rnd + 1) % 10 == 0:
            print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)

    n_steps = args.rounds * args.steps_per_round
    rows = []
    for r in recipes:
        ratio = paired_ratio(times[r], times["bf16-mixed"])
        own_ms = 1e3 * runs[r].own / n_steps
        rows.append({
            "recipe": r, "step_ms": 1e3 * Summary.of(times[r]).median, "vs_bf16_mixed": ratio,
            "vs_bf16_true": paired_ratio(times[r], times["bf16-true"]),
            "masters_ms": own_ms, "tensors": runs[r].tensors, "param_bytes_16bit": runs[r].bytes16,
            "masters_us_per_tensor": 1e3 * own_ms / runs[r].tensors if runs[r].tensors else None,
            "masters_ns_per_param_byte": 1e6 * own_ms / runs[r].bytes16 if runs[r].bytes16 else None,
            "kernels": getattr(runs[r].mp.masters, "kernels", None) and runs[r].mp.masters.kernels.describe(),
        })
    what = (f"the reference block ({shape.describe()})" if args.model == "block"
            else f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}")
    print(f"\n{what}, {device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, mixprec from {src}")
    print(f"load before: {load_before}\nload after:  {uptime()}")
    print("| recipe | tensors | step ms | vs bf16-mixed (95% CI) | vs bf16-true (95% CI) | masters ms/step | "
          "us/tensor | ns/param byte |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        v, t = row["vs_bf16_mixed"], row["vs_bf16_true"]
        per = "-" if row["masters_us_per_tensor"] is None else f"{row['masters_us_per_tensor']:.1f}"
        nsb = "-" if row["masters_ns_per_param_byte"] is None else f"{row['masters_ns_per_param_byte']:.2f}"
        print(f"| {row['recipe']} | {row['tensors']} | {row['step_ms']:.2f} | {v['median']:.3f} "
              f"({v['ci95_low']:.3f}-{v['ci95_high']:.3f}) | {t['median']:.3f} ({t['ci95_low']:.3f}-{t['ci95_high']:.3f}) "
              f"| {row['masters_ms']:.2f} | {per} | {nsb} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        from mixprec.instruments.machine import environment

        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": environment(device), "uptime_before": load_before,
                                               "uptime_after": uptime(), "torch": torch.__version__, "rows": rows,
                                               "samples_s": times}, indent=1))
    return 0


def uptime() -> str:
    import os
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
