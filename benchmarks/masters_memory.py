"""Memory and step time of 16-bit storage (each master-weight variant) against bf16-mixed and fp32.

One model (the built-in char GPT), one optimizer (AdamW), every recipe: bytes per parameter
measured from one real step (``mixprec.memory.measure``), and step time as the median of
interleaved rounds (every round runs each recipe in turn, rotating the order, so load from other
processes falls on all of them alike). Ratios are against fp32 on the same device.

On CPUs without native bf16 (AVX512-BF16/AMX) 16-bit matmuls are emulated: the ratios there show
the emulation cost, not what the recipes cost on a GPU.

    python benchmarks/masters_memory.py                      # CPU, defaults
    python benchmarks/masters_memory.py --device cuda --d-model 1024 --layers 8 --batch 16 --seq 512
    python benchmarks/masters_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.memory import facts_from_recipe, plan  # noqa: E402
from mixprec.memory.measure import make_optimizer, measure_step  # noqa: E402
from mixprec.recipes import as_device, get_recipe  # noqa: E402
from mixprec.tasks import load_task, to_device  # noqa: E402

RECIPES = ["fp32", "bf16-mixed", "bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_runner(task, recipe: str, device: torch.device):
    """A closure running one training step of ``recipe`` (model, optimizer, data prepared once)."""
    torch.manual_seed(0)
    mp = MixedPrecision(recipe, device)
    model = mp.prepare(task.build_model().to(device))
    opt = make_optimizer("adamw", mp.parameters(model), device)
    x, y = to_device(task.get_batch(0), device)

    def step() -> None:
        with mp.autocast():
            out = task.run_forward(model, x)
        mp.step(task.loss_fn(out, y), opt, max_grad_norm=1.0)

    step()  # warm-up: optimizer state, autocast caches, kernels
    return step


def time_interleaved(runners: dict, device: torch.device, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each runner over ``rounds`` interleaved rounds of ``steps`` steps."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                runners[name]()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--bucket-numel", type=int, default=None,
                    help="elements per bucket of the master-weight step (default 2**24): a small value makes "
                         "this small model step in several buckets, as a large one does")
    args = ap.parse_args(argv)
    if args.bucket_numel:
        import mixprec.masters.buckets as buckets

        buckets.BUCKET_NUMEL = args.bucket_numel

    device = as_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    task = load_task(None, batch_size=args.batch, seq_len=args.seq, d_model=args.d_model,
                     n_layer=args.layers, n_head=args.heads)
    recipes = args.recipes.split(",")
    if "fp32" not in recipes:
        recipes.insert(0, "fp32")

    rows = {}
    for recipe in recipes:
        m = measure_step(task, recipe, "adamw", device)
        p = plan(m.counts, facts_from_recipe(get_recipe(recipe)), "adamw")
        n = m.counts.total
        persistent = m.bytes["weights"] + m.bytes["masters"] + m.bytes["optimizer state"]
        rows[recipe] = {
            "params": n,
            "measured_bytes": m.bytes,
            "persistent_bytes_per_param": persistent / n,
            "planned_persistent_bytes_per_param": p.persistent / n,
            "weights_grads_masters_per_param": (m.bytes["weights"] + m.bytes["gradients"] + m.bytes["masters"]) / n,
            "step_time_fp32_per_param": m.bytes["step-time fp32"] / n,
            "planned_step_time_fp32_per_param": p.bytes["step-time fp32"] / n,
            "planned_peak_bytes_per_param": p.peak / n,
            "activations_bytes": m.bytes["activations"] + m.bytes["autocast weight copies"],
            "cuda_peak_allocated": m.peak_allocated,
        }
    runners = {r: make_runner(task, r, device) for r in recipes}
    secs = time_interleaved(runners, device, args.rounds, args.steps)
    for r in recipes:
        rows[r]["step_seconds"] = secs[r]
        rows[r]["step_time_vs_fp32"] = secs[r] / secs["fp32"]

    from rich.console import Console
    from rich.table import Table

    from mixprec.masters.buckets import BUCKET_NUMEL

    env = f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads, buckets of {BUCKET_NUMEL:,} elements"
    table = Table(title=f"{task.description}; AdamW; {env}")
    for col in ("recipe", "persistent B/param", "w+g+masters B/param", "step-time fp32 B/param",
                "planned peak B/param", "activations", "step ms", "vs fp32"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for r, row in rows.items():
        table.add_row(r, f"{row['persistent_bytes_per_param']:.2f}", f"{row['weights_grads_masters_per_param']:.2f}",
                      f"{row['step_time_fp32_per_param']:.2f}", f"{row['planned_peak_bytes_per_param']:.2f}",
                      f"{row['activations_bytes'] / 1e6:.2f} MB",
                      f"{row['step_seconds'] * 1e3:.1f}", f"{row['step_time_vs_fp32']:.2f}x")
    Console(width=160).print(table)
    print("persistent = weights + masters + optimizer state (measured); fp32 norms/biases/embeddings included.")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json), "env": env},
                                         "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
