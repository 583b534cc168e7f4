"""One rank of ``test_dist_probe.py``: ``python probe_workers.py SCENARIO[,SCENARIO...] OUT``.

Started by ``dist_helpers.spawn`` (2 gloo ranks); writes ``OUT/rank{RANK}.json`` through
``workers.rank_main``: observations only, the tests judge them.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mixprec
from mixprec.distributed import CheckpointError, checkpoint_io, load_checkpoint, save_checkpoint
from mixprec.tasks import charlm
from workers import RANK, TASK, WORLD, leave, micro, rank_main


def _digest(mp, model) -> str:
    """The optimizer's fp32 values and the model's own (16-bit) parameters, bitwise."""
    h = hashlib.sha1()
    for kind, named in (("opt", mp.named_parameters(model)), ("model", model.named_parameters())):
        for name, p in sorted(named, key=lambda kv: kv[0]):
            t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            h.update(f"{kind} {name.removeprefix('module.')}".encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build(recipe, parallel, seed=0):
    torch.manual_seed(seed)
    model = TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(model, parallel=parallel)
    return mp, model, torch.optim.AdamW(mp.parameters(model), lr=1e-2)


def _train(mp, model, opt, start, stop):
    for step in range(start, stop):
        x, y = micro(step, RANK)
        with mp.autocast():
            logits = model(x)
        mp.step(charlm.lm_loss(logits, y), opt)


def scenario_sr_seeded_per_rank(out: Path) -> dict:
    """bf16-true-sr under DDP on ranks seeded ``manual_seed(1000 + rank)`` (as scripts do for dropout):
    the parameters after each step, as a digest."""
    mp, model, opt = _build("bf16-true-sr", "ddp", seed=1000 + RANK)
    digests = [_digest(mp, model)]
    for step in range(3):
        _train(mp, model, opt, step, step + 1)
        digests.append(_digest(mp, model))
    return {"digests": digests}


def scenario_digest_fails_on_one_rank(out: Path) -> dict:
    """A save whose reading back of a file fails on rank 1 only (after DCP wrote every file)."""
    root = out / "ckpt-digest"
    mp, model, opt = _build("fp16-mixed", "ddp")
    _train(mp, model, opt, 0, 2)
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    _train(mp, model, opt, 2, 3)
    orig = checkpoint_io.digests
    if RANK == 1:
        def failing(*args, **kwargs):
            raise OSError(5, "Input/output error (injected)")
        checkpoint_io.digests = failing
    result: dict = {}
    try:
        save_checkpoint(root, model=model, optimizer=opt, mp=mp)
        result["error"] = None
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        checkpoint_io.digests = orig
    result["latest"] = (root / "latest").read_text().strip()
    # the ranks are still paired: one collective of known content, then a save that works
    seen: list = [None] * WORLD
    dist.all_gather_object(seen, ("rank", RANK))
    result["gathered"] = seen
    result["saved_after"] = Path(save_checkpoint(root, model=model, optimizer=opt, mp=mp)).name
    return result


def scenario_save_without_parallel(out: Path) -> dict:
    """Two ranks that called ``mp.prepare(model)`` without ``parallel=`` train on their own micro-batches
    (the replicas go apart), then save; then the same model wrapped in the user's own DDP."""
    result: dict = {}
    for how in ("plain", "own-ddp"):
        torch.manual_seed(0)
        model = TASK.build_model()
        mp = mixprec.MixedPrecision("bf16-mixed", "cpu")
        model = mp.prepare(model)
        if how == "own-ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
        _train(mp, model, opt, 0, 2)
        root = out / f"ckpt-{how}"
        try:
            result[how] = Path(save_checkpoint(root, model=model, optimizer=opt, mp=mp)).name
        except CheckpointError as e:
            result[how] = f"CheckpointError: {e}"
        result[f"{how} files"] = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return result


def main() -> int:
    scenarios, out_dir = sys.argv[1].split(","), Path(sys.argv[2])

    def body(result: dict) -> None:
        for name in scenarios:
            result[name] = globals()[f"scenario_{name}"](out_dir)

    return rank_main(body, out_dir)


if __name__ == "__main__":
    leave(main())
