"""One rank of the checkpoint fault tests: ``python ckpt_worker.py MODE CASE ROOT KILL``.

MODE: ``ddp`` or ``fsdp``. CASE: ``next`` (save at step 2, train on, save at step 4) or ``again``
(save at step 2; then a run from scratch with other weights saves step 2 again onto the same
path: ``train_distributed.py --checkpoint ckpt`` run twice), or ``damage`` (no kill: load damaged
copies of a checkpoint on every rank, write ``ROOT.rank{RANK}.json``; see ``damage``). Before the second save rank 0 writes
``ROOT.expect.json``: the digest of the state each save holds (``old``, ``new``). KILL is
``POINT@RANK`` or ``none``: that rank SIGKILLs itself when its second save reaches POINT, one of
the points of ``checkpoint_layout._fault_point`` or, inside DCP's writer, ``shard:before`` (before
the rank writes its file), ``shard:mid`` (its file half written, flushed), ``shard:after`` (its
file written, before DCP gathers the ranks' results). Started by ``dist_helpers.run_ranks``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from ckpt_state import build, local_digest, state_digest, train  # noqa: E402
from mixprec.distributed import checkpoint_layout, load_checkpoint, save_checkpoint  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def die(point: str) -> None:
    print(f"rank {RANK}: killed at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill: str) -> None:
    """Make this rank die at the named point of its next save."""
    if kill == "none":
        return
    point, rank = kill.split("@")
    if int(rank) != RANK:
        return
    from torch.distributed.checkpoint import filesystem

    if point == "shard:before" or point == "shard:after":
        write_data = filesystem.FileSystemWriter.write_data

        def patched(self, plan, planner):
            if point == "shard:before":
                die(point)
            future = write_data(self, plan, planner)
            die(point)
            return future
        filesystem.FileSystemWriter.write_data = patched
    elif point == "shard:mid":
        write_item, written = filesystem._write_item, []

        def patched_item(transforms, stream, *args, **kwargs):
            result = write_item(transforms, stream, *args, **kwargs)
            written.append(result)
            if len(written) == 3:  # a few tensors in, the rest not
                stream.flush()
                die(point)
            return result
        filesystem._write_item = patched_item
    else:
        def fault(name: str) -> None:
            if name == point:
                die(point)
        checkpoint_layout._fault_point = fault


def _damage(case: str, root: Path) -> Path:
    """Rank 0: a copy of ``root`` damaged as ``case`` says (the newest checkpoint, rank 1's shard)."""
    import shutil

    target = root.with_name(f"{root.name}-{case}")
    shutil.copytree(root, target)
    shard = target / "step-000003" / "__1_0.distcp"
    if case == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "deleted":
        shard.unlink()
    elif case == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 1
        shard.write_bytes(bytes(data))
    elif case == "no-marker":
        (target / "step-000003" / checkpoint_layout.MARKER).unlink()
    elif case == "foreign":
        shutil.rmtree(target)
        target.mkdir()
        (target / "data.bin").write_bytes(b"x")
    return target


DAMAGE = ("truncated", "deleted", "flipped", "no-marker", "foreign", "shape")


def damage(mode: str, root: Path) -> dict:
    """Each damaged checkpoint loaded on every rank: the message each rank raised, and whether this
    rank's tensors, optimizer state and scaler stayed as they were."""
    mp, model, opt = build(mode)
    train(mp, model, opt, 2, rank=RANK, world=WORLD)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    train(mp, model, opt, 1, start=2, rank=RANK, world=WORLD)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    out = {}
    for case in DAMAGE:
        path = _damage(case, root) if RANK == 0 and case != "shape" else root.with_name(f"{root.name}-{case}")
        dist.barrier()
        m, mod, o = build(mode, seed=7, d_ff=64 if case == "shape" else None)
        train(m, mod, o, 1, rank=RANK, world=WORLD)
        before = local_digest(m, mod, o)
        try:
            load_checkpoint(root if case == "shape" else path, model=mod, optimizer=o, mp=m)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        out[case] = {"error": error, "unchanged": local_digest(m, mod, o) == before}
    # saving onto a regular file, and the group still works afterwards
    if RANK == 0:
        root.with_name("a-file").write_bytes(b"x")
    dist.barrier()
    try:
        save_checkpoint(root.with_name("a-file"), model=model, optimizer=opt, mp=mp)
        out["save-onto-file"] = {"error": None}
    except Exception as e:
        out["save-onto-file"] = {"error": f"{type(e).__name__}: {e}"}
    m, mod, o = build(mode, seed=7)
    out["then"] = load_checkpoint(root, model=mod, optimizer=o, mp=m)
    out["then_digest"] = state_digest(m, mod, o) == state_digest(mp, model, opt)
    return out


def main() -> int:
    mode, case, root, kill = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=os.environ["MIXPREC_DIST_INIT"], rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    if case == "damage":
        result = damage(mode, root)
        Path(f"{root}.rank{RANK}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    mp, model, opt = build(mode)
    train(mp, model, opt, 2, rank=RANK, world=WORLD)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    old = state_digest(mp, model, opt)
    if case == "next":
        train(mp, model, opt, 2, start=2, rank=RANK, world=WORLD)
    else:
        mp, model, opt = build(mode, seed=1)
        train(mp, model, opt, 2, rank=RANK, world=WORLD)
    new = state_digest(mp, model, opt)
    if RANK == 0:
        Path(f"{root}.expect.json").write_text(json.dumps({"old": old, "new": new, "steps": mp.state_dict()["steps"]}))
    dist.barrier()
    arm(kill)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    print(f"rank {RANK}: saved", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:  # the ranks that lost their peer: say what they saw, exit non-zero
        print(f"rank {RANK}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)  # (see workers.py: gloo's threads and the interpreter's teardown)
