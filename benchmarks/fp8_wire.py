"""fp8 all-gather under FSDP2: the bytes each rank puts on the wire per training step, fp32 against fp8.

    python benchmarks/fp8_wire.py --json benchmarks/results/fp8_wire_gloo.json
    python benchmarks/fp8_wire.py --world 2 --d-model 512 --layers 8          # a larger model

Spawns ``world`` gloo ranks on this machine (a FileStore in a temporary directory), each training the
built-in char GPT under fp8-current with ``parallel=FSDP(fp8_all_gather=...)`` off and on, and counts
the bytes of every all-gather FSDP2 issues (``dist.all_gather_single``'s input on this rank: what it
sends). The parameters after the steps are compared across the two runs (the fp8 bits gathered are
the ones the layer would cast: the runs are bit for bit the same). Step times on gloo over loopback are
indicative only; the byte counts are exact and hold for NCCL too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp_

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    import mixprec
    from mixprec.distributed import FSDP
    from mixprec.fp8 import fp8_layers
    from mixprec.tasks import charlm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    task = charlm.make_task(batch_size=2 * args.world, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers,
                            n_head=4)
    real = dist.all_gather_single
    result = {}
    for gather8 in (False, True):
        sent: list[int] = []

        def counted(output, input, *a, **k):
            sent.append(input.numel() * input.element_size())
            return real(output, input, *a, **k)

        torch.manual_seed(0)
        mp = mixprec.MixedPrecision("fp8-current", "cpu")
        model = mp.prepare(task.build_model(), parallel=FSDP(fp8_all_gather=gather8))
        opt = torch.optim.AdamW(mp.parameters(model), lr=1e-3)
        dist.all_gather_single = counted
        t0 = time.perf_counter()
        for step in range(args.steps):
            x, y = task.get_batch(step)
            with mp.autocast():
                loss = task.loss_fn(model(x.chunk(args.world)[rank]), y.chunk(args.world)[rank])
            mp.step(loss, opt)
        wall = time.perf_counter() - t0
        dist.all_gather_single = real
        h = hashlib.sha1()
        for n, p in sorted(mp.named_parameters(model)):
            h.update(p.full_tensor().detach().float().contiguous().view(torch.uint8).numpy().tobytes())
        n8 = sum(m.weight.to_local().numel() for _, m in fp8_layers(model))
        result[f"gather8={gather8}"] = {"bytes_per_step": sum(sent) / args.steps, "calls_per_step": len(sent) / args.steps,
                                        "step_s": wall / args.steps, "params_sha1": h.hexdigest(),
                                        "fp8_weight_elements_per_rank": n8}
    dist.barrier()  # every rank done with its collectives before the group is torn down
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp_.spawn(_rank, args=(args, os.path.join(tmp, "store"), tmp), nprocs=args.world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    off, on = ranks[0]["gather8=False"], ranks[0]["gather8=True"]
    same = all(r["gather8=False"]["params_sha1"] == r["gather8=True"]["params_sha1"] for r in ranks)
    n8 = on["fp8_weight_elements_per_rank"]
    doc = {"kind": "mixprec-fp8-wire", "args": vars(args), "ranks": ranks, "bitwise_same": same,
           "torch": torch.__version__, "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(f"fp8-current under FSDP2 on {args.world} gloo ranks, char GPT d_model {args.d_model}, {args.layers} layers "
          f"({n8} fp8 weight elements per rank); per rank and step:\n")
    print("| all-gather | bytes sent | calls | step s (gloo, indicative) |\n|---|---|---|---|")
    for name, r in (("fp32 (default)", off), ("fp8 (fp8_all_gather=True)", on)):
        print(f"| {name} | {r['bytes_per_step']:,.0f} | {r['calls_per_step']:.0f} | {r['step_s']:.3f} |")
    print(f"\nsaved {off['bytes_per_step'] - on['bytes_per_step']:,.0f} B per step = 3 B x {n8} fp8 weight elements x "
          f"{(off['bytes_per_step'] - on['bytes_per_step']) / (3 * n8):.0f} gathers; the two runs bit for bit the same: "
          f"{same}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
