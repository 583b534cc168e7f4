"""One device, three paths: the one-process step, FSDP2 on a one-rank mesh and DDP on one rank.

    torchrun --standalone --nproc_per_node 1 benchmarks/gpu/distributed.py --out $OUT/distributed.json
    torchrun --standalone --nproc_per_node 1 benchmarks/gpu/distributed.py --device cpu --quick   # dry run

What it measures, per recipe (bf16-mixed, fp16-mixed, bf16-true by default), on the same model,
data and seed, ``--steps`` steps each, the three paths side by side in one process:

- ``equal``: whether the losses and the final parameters (the fp32 masters of a 16-bit storage
  recipe) are bitwise those of the one-process path. On one rank FSDP2's all-gather and
  reduce-scatter move nothing, so its numbers should match exactly: the cast to the compute dtype
  happens at the gather instead of inside autocast, the fp32 islands and embeddings stay fp32.
  DDP on one rank averages over one rank (a division by 1).
- ``max_abs_diff``: the largest parameter difference (0 when equal).
- ``step_ms``: the median step time after ``--warmup`` steps (CUDA events), and ``vs_one``: the
  ratio to the one-process path (> 1: slower). FSDP2's hooks, copies and its (one-rank) NCCL
  calls are what it costs on one device.
- ``peak_mb``: ``torch.cuda.max_memory_allocated`` over the timed steps (CPU: not measured).

The file also names the machine (device, torch, date). It is not a multi-GPU benchmark: bytes on
the wire across ranks are worked out in docs/distributed.md, not measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

import mixprec
from mixprec.distributed.launch import init_from_env
from mixprec.tasks import charlm


def run(task, recipe: str, parallel: str | None, steps: int, warmup: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision(recipe, device)
    model = task.build_model().to(device)
    model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": False}
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-3, **fused)
    losses, times = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    for step in range(steps):
        if step == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        x, y = (t.to(device) for t in task.get_batch(step))
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        with mp.autocast():
            logits = model(x)
        stats = mp.step(charlm.lm_loss(logits, y), opt, max_grad_norm=1.0)
        if cuda:
            end.record()
            times.append((begin, end))
        else:
            times.append(time.perf_counter() - start)
        losses.append(stats.loss.detach().float())
    if cuda:
        torch.cuda.synchronize()
        ms = [b.elapsed_time(e) for b, e in times[warmup:]]
    else:
        ms = [t * 1e3 for t in times[warmup:]]
    params = {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
              for n, p in mp.named_parameters(model)}
    return {"losses": [float(v) for v in torch.stack(losses).cpu()], "params": params,
            "step_ms": statistics.median(ms) if ms else float("nan"),
            "peak_mb": torch.cuda.max_memory_allocated() / 1e6 if cuda else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--recipes", default="bf16-mixed,fp16-mixed,bf16-true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few steps (a dry run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world, device = init_from_env(args.device)
    if world != 1:
        raise SystemExit(f"run on one rank (torchrun --nproc_per_node 1), got {world}")
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), 1
        task = charlm.make_task(batch_size=4, seq_len=16, d_model=32, n_layer=1, n_head=2)
    else:  # a step long enough to time on an H200, small enough for a minute
        task = charlm.make_task(batch_size=32, seq_len=256, d_model=512, n_layer=6, n_head=8)
    results = {"machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                           "task": task.description, "steps": args.steps, "warmup": args.warmup},
               "recipes": {}}
    for recipe in args.recipes.split(","):
        one = run(task, recipe, None, args.steps, args.warmup, device)
        row = {"one": {"step_ms": one["step_ms"], "peak_mb": one["peak_mb"]}}
        for parallel in ("fsdp", "ddp"):
            got = run(task, recipe, parallel, args.steps, args.warmup, device)
            diff = max(float((got["params"][n] - one["params"][n]).abs().max()) for n in one["params"])
            row[parallel] = {"equal": got["losses"] == one["losses"] and diff == 0.0, "max_abs_diff": diff,
                             "step_ms": got["step_ms"], "vs_one": got["step_ms"] / one["step_ms"],
                             "peak_mb": got["peak_mb"]}
        results["recipes"][recipe] = row
        print(recipe, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()  # every rank done with its collectives before the group is torn down
    dist.destroy_process_group()
    return 0 if all(r[p]["equal"] for r in results["recipes"].values() for p in ("fsdp", "ddp")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
