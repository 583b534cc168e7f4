"""Data-parallel training with mixprec on torch.distributed: the one-process loop, on every rank.

    torchrun --nproc_per_node 2 examples/train_distributed.py                       # CPU: gloo
    torchrun --nproc_per_node 8 examples/train_distributed.py --device cuda --parallel fsdp --recipe bf16-mixed
    torchrun --nproc_per_node 2 examples/train_distributed.py --steps 40 --checkpoint ckpt   # save ckpt/step-000040
    torchrun --nproc_per_node 2 examples/train_distributed.py --steps 40 --resume ckpt --checkpoint ckpt  # go on

Each step's global batch is split over the ranks; the loss printed is the mean over them. The
built-in character model trains on the corpus mixprec ships; swap in your own model and data.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import mixprec
from mixprec.distributed import load_checkpoint, save_checkpoint
from mixprec.tasks import charlm


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="bf16-mixed")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="fsdp")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per rank)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch: split over the ranks")
    parser.add_argument("--checkpoint", default=None, help="save model, optimizer and mixprec state at the end, as "
                        "CHECKPOINT/step-N (published atomically; CHECKPOINT/latest names the newest)")
    parser.add_argument("--keep", type=int, default=None, help="keep only the last KEEP checkpoints in --checkpoint")
    parser.add_argument("--resume", default=None, help="load a checkpoint first: a --checkpoint directory (its "
                        "latest) or one step-N directory in it")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait for the other ranks before it raises (a rank that died "
                             "or stopped); torch's default is 30 minutes (default: %(default)g)")
    args = parser.parse_args(argv)
    # said now, not after the training run: a --keep that save_checkpoint refuses, or one nothing would read
    if args.keep is not None and args.keep < 1:
        parser.error(f"--keep {args.keep}: keep at least 1 checkpoint (or leave it out to keep them all)")
    if args.keep is not None and not args.checkpoint:
        parser.error("--keep applies to the checkpoints --checkpoint saves; add --checkpoint DIR")
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout:g}: give the seconds a collective may wait, > 0")
    if args.steps < 0 or args.batch < 1:
        parser.error(f"--steps {args.steps} --batch {args.batch}: --steps must be >= 0 and --batch >= 1")

    cuda = args.device.startswith("cuda")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split over {world} ranks")

    task = charlm.make_task(batch_size=args.batch, seq_len=32, d_model=48)
    torch.manual_seed(0)  # the same initial weights everywhere (prepare broadcasts rank 0's anyway)
    mp = mixprec.MixedPrecision(args.recipe, device)
    model = mp.prepare(task.build_model().to(device), parallel=args.parallel)
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
    start = 0
    if args.resume:
        loaded = load_checkpoint(args.resume, model=model, optimizer=opt, mp=mp)
        start = mp.state_dict()["steps"]
        if rank == 0:
            print(f"resumed from {loaded} (step {start})")
    if rank == 0:
        print(mp.describe())

    loss = torch.zeros(())
    for step in range(start, start + args.steps):
        x, y = task.get_batch(step)  # the global batch; this rank trains on its slice
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        with mp.autocast():
            logits = model(x)
        stats = mp.step(charlm.lm_loss(logits, y), opt, max_grad_norm=1.0)
        loss = stats.loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
        if rank == 0 and (step % 10 == 0 or step == start + args.steps - 1):
            print(f"step {step:4d}  loss {float(loss):.4f}  scale {float(stats.scale):g}"
                  + ("  (skipped)" if bool(stats.skipped) else ""), flush=True)
    if args.checkpoint:
        saved = save_checkpoint(args.checkpoint, model=model, optimizer=opt, mp=mp, keep=args.keep)
        if rank == 0:
            print(f"checkpoint: {saved}")
    dist.barrier()  # every rank done with its collectives before the group is torn down
    dist.destroy_process_group()
    return float(loss)


if __name__ == "__main__":
    main()
    # torch 2.13 with gloo: a rank can abort in the interpreter's teardown after a clean run
    # ("terminate called without an active exception"). The checkpoint is saved by now: leave
    # without the teardown, so that torchrun sees the exit status the run earned.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
