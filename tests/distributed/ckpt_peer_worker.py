"""One rank of the lost-peer checkpoint tests: ``python ckpt_peer_worker.py CASE ROOT``.

``die``: rank 1 exits before the save (rank 0 must say another rank stopped, not "rank 0 stopped").
``raise``: rank 1's building of the state raises before the save's first collective (every rank must
get the same ``CheckpointError`` naming rank 1, at once, and training goes on). Each rank prints
``rank R: <what save_checkpoint raised or did>``.
``badarg``: rank 1 alone passes ``keep=0`` to the save, then ``checksums="no"`` to a load (every rank must
get the same ``CheckpointError`` naming rank 1, not a hang). ``paths``: each rank is given its own path.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ckpt_state import build, train
from mixprec.distributed import checkpoint as ck
from mixprec.distributed import save_checkpoint

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _arguments(case: str, root: Path, mp, model, opt) -> int:
    from mixprec.distributed import load_checkpoint

    keep = 0 if RANK == 1 and case == "badarg" else None
    where = root / f"rank{RANK}" if case == "paths" else root
    for doing, call in (("save", lambda: save_checkpoint(where, model=model, optimizer=opt, mp=mp, keep=keep)),
                        ("load", lambda: load_checkpoint(where, model=model, optimizer=opt, mp=mp,
                                                         checksums="no" if keep == 0 else True))):
        try:
            call()
            print(f"rank {RANK}: {doing}: done", flush=True)
        except Exception as e:
            print(f"rank {RANK}: {doing}: {type(e).__name__}: {e}", flush=True)
    save_checkpoint(root / "after", model=model, optimizer=opt, mp=mp)  # still in step
    print(f"rank {RANK}: saved after the refused calls", flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    case, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=os.environ["MIXPREC_DIST_INIT"], rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    mp, model, opt = build("ddp")
    train(mp, model, opt, 2, rank=RANK, world=WORLD)
    if case == "die" and RANK == 1:
        os._exit(3)
    orig = ck._state
    if case == "raise" and RANK == 1:
        def bad(*args, **kwargs):
            raise RuntimeError("injected: building the state failed on rank 1")
        ck._state = bad
    if case in ("badarg", "paths"):
        return _arguments(case, root, mp, model, opt)
    try:
        save_checkpoint(root, model=model, optimizer=opt, mp=mp)
        print(f"rank {RANK}: saved", flush=True)
    except Exception as e:
        print(f"rank {RANK}: {type(e).__name__}: {e}", flush=True)
    if case == "raise":  # the ranks are still in step: the next save works on both
        ck._state = orig
        save_checkpoint(root, model=model, optimizer=opt, mp=mp)
        print(f"rank {RANK}: saved after the refused save", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # (see workers.py: gloo's threads abort the interpreter's teardown now and then)
