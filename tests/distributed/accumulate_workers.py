"""One rank of the accumulation tests: ``python accumulate_workers.py OUT``.

For each recipe, DDP with ``accumulate=3`` on 2 ranks, two ways: the plain loop (``mp.step`` per
micro-batch, nothing else), and the loop a user writes for DDP by hand, with ``model.no_sync()``
around the forward and the step of every micro-step before the last. Each rank counts the
collectives its process group makes during each ``mp.step`` call (the group's own sequence number,
``ProcessGroup._get_sequence_number_for_group``, which gloo advances once per collective) and the
digest of the parameters after one window. FSDP2 runs the plain loop too (bf16-mixed).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import workers as W  # noqa: E402

import mixprec  # noqa: E402
from mixprec.tasks import charlm  # noqa: E402

RANK, WORLD = W.RANK, W.WORLD
K = 3
RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
TASK = charlm.make_task(batch_size=WORLD * K, seq_len=16, d_model=32, n_layer=2, n_head=4)  # one sequence a micro-step


def _count() -> int:
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def run(recipe: str, mode: str, by_hand: bool) -> dict:
    torch.manual_seed(0)
    model = TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", accumulate=K)
    model = mp.prepare(model, parallel=mode)
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    per_call = []
    for step in range(1):
        x, y = TASK.get_batch(step)
        xs, ys = x.chunk(WORLD)[RANK].chunk(K), y.chunk(WORLD)[RANK].chunk(K)
        for m in range(K):
            quiet = by_hand and m < K - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                with mp.autocast():
                    logits = model(xs[m])
                before = _count()
                stats = mp.step(charlm.lm_loss(logits, ys[m]), opt)
                per_call.append(_count() - before)
        assert stats.stepped
    return {"collectives": per_call, "digest": W.digest(W.params(mp, model)), "steps": mp._steps}


def main() -> int:
    def body(result: dict) -> None:
        for recipe in RECIPES:
            result[f"ddp/{recipe}"] = run(recipe, "ddp", False)
            result[f"ddp/{recipe}/by_hand"] = run(recipe, "ddp", True)
        result["fsdp/bf16-mixed"] = run("bf16-mixed", "fsdp", False)

    return W.rank_main(body, Path(sys.argv[1]))


if __name__ == "__main__":
    W.leave(main())
