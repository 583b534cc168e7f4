"""One rank of the fp8 distributed tests: ``python fp8_dist_worker.py SCENARIO OUT`` (RANK, WORLD_SIZE and
MIXPREC_DIST_INIT, a FileStore, in the environment); writes ``OUT/rank{RANK}.json`` with observations only.

``match``: fp8-current and fp8-delayed under DDP and FSDP2 against one process that trains on the same
global batch as WORLD accumulated micro-batches in rank order; digests of the parameters and of the fp8
scaling state.

ONE_PROCESS: a rank backpropagates its own micro-batch's loss (DDP averages the gradients afterwards),
while accumulation divides each micro-batch's loss by WORLD first: the fp8 layers would see output
gradients WORLD times smaller, and fp8 casts of ``g`` and ``2 g`` at TE's first-step scale of 1 differ
near the subnormals. So the reference passes ``loss * WORLD`` (its backward then sees exactly what the
rank's sees) and halves the accumulated gradients before the optimizer step (exact: a power of two),
which is ``g0/2 + g1/2``, DDP's average, bit for bit. ``local``: fp8-delayed under DDP with ``reduce_amax=False``. ``wire``: the bytes one
FSDP2 all-gather of the fp8 layers' weights puts on the wire, fp32 against fp8 (``fp8_all_gather``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import workers as W  # noqa: E402  (tests/distributed: one rank's start and teardown)

import mixprec  # noqa: E402
from mixprec.fp8 import fp8_layers  # noqa: E402
from mixprec.tasks import charlm  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TASK = charlm.make_task(batch_size=2 * WORLD, seq_len=16, d_model=32, n_layer=2, n_head=4)
STEPS = 3


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state(mp, model) -> dict:
    params = {n.removeprefix("module."): full(p).detach().float().clone() for n, p in mp.named_parameters(model)}
    local = model.module if hasattr(model, "module") else model
    fp8 = {f"{n}.{b}": getattr(m, b).clone() for n, m in fp8_layers(local) for b in ("fp8_amax_history", "fp8_scale")
           if getattr(m, b, None) is not None}
    return {"params": digest(params), "fp8": digest(fp8) if fp8 else None, "n_fp8": len(fp8_layers(local)),
            # after 3 steps a 4-long history reads [0, step 0, step 1, step 2] (TE's roll)
            "step0_amax": {k: v[1].tolist() for k, v in fp8.items() if k.endswith("history")}}


def run(recipe: str, parallel, fp8=None) -> dict:
    """Train 3 steps; the state reached (``state``) and, sharded, this rank's elements of fp8 weights."""
    torch.manual_seed(0)
    model = TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", accumulate=1 if parallel else WORLD, fp8=fp8)
    model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    if not parallel:  # (see ONE_PROCESS)
        def average(o, args, kwargs):
            for g in o.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.div_(WORLD)

        opt.register_step_pre_hook(average)
    for step in range(STEPS):
        x, y = TASK.get_batch(step)
        parts = [RANK] if parallel else range(WORLD)
        for k in parts:
            with mp.autocast():
                loss = TASK.loss_fn(model(x.chunk(WORLD)[k]), y.chunk(WORLD)[k])
            mp.step(loss if parallel else loss * WORLD, opt)
    out = state(mp, model)
    local = model.module if hasattr(model, "module") else model
    out["fp8_weight_shard_numel"] = sum(m.weight.to_local().numel() if hasattr(m.weight, "to_local") else 0
                                        for _, m in fp8_layers(local))
    out["gathered_as"] = sorted({type(m.weight.to_local()).__name__ for _, m in fp8_layers(local)
                                 if hasattr(m.weight, "to_local")})
    return out


class WireBytes:
    """Counts the bytes each all-gather this rank sends (FSDP2 calls ``dist.all_gather_single``)."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self._real = dist.all_gather_single

    def __enter__(self) -> "WireBytes":
        def counted(output, input, *args, **kwargs):
            self.sent.append(input.numel() * input.element_size())
            return self._real(output, input, *args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather_single = self._real


def wire() -> dict:
    from mixprec.distributed import FSDP

    out = {}
    for gather8 in (False, True):
        with WireBytes() as wb:
            r = run("fp8-current", FSDP(fp8_all_gather=gather8))
        r["all_gather_bytes_per_step"] = sum(wb.sent) / STEPS
        out[f"fsdp/fp8-current/gather8={gather8}"] = r
    return out


def resume(path: Path) -> dict:
    """fp8 all-gather through a sharded checkpoint: save after step 1, go on; load into a fresh model, go on."""
    from mixprec.distributed import FSDP, load_checkpoint, save_checkpoint

    def fresh():
        torch.manual_seed(0)
        mp = mixprec.MixedPrecision("fp8-current", "cpu")
        model = mp.prepare(TASK.build_model(), parallel=FSDP(fp8_all_gather=True))
        return mp, model, torch.optim.AdamW(mp.parameters(model), lr=1e-2)

    def steps(mp, model, opt, which):
        for step in which:
            x, y = TASK.get_batch(step)
            with mp.autocast():
                loss = TASK.loss_fn(model(x.chunk(WORLD)[RANK]), y.chunk(WORLD)[RANK])
            mp.step(loss, opt)

    mp, model, opt = fresh()
    steps(mp, model, opt, range(2))
    save_checkpoint(str(path), model=model, optimizer=opt, mp=mp)
    steps(mp, model, opt, range(2, 4))
    straight = state(mp, model)["params"]
    mp2, model2, opt2 = fresh()
    load_checkpoint(str(path), model=model2, optimizer=opt2, mp=mp2)
    steps(mp2, model2, opt2, range(2, 4))
    return {"straight": straight, "resumed": state(mp2, model2)["params"]}


def match() -> dict:
    out = wire()
    out["resume"] = resume(Path(sys.argv[2]) / "ckpt")
    for recipe in ("fp8-current", "fp8-delayed"):
        fp8 = {"amax_history_len": 4} if recipe == "fp8-delayed" else None
        out[f"ref/{recipe}"] = run(recipe, None, fp8)
        for mode in ("ddp", "fsdp"):
            out[f"{mode}/{recipe}"] = run(recipe, mode, fp8)
    out["ddp/fp8-delayed/local"] = run("fp8-delayed", "ddp", {"amax_history_len": 4, "reduce_amax": False})
    return out


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    return W.rank_main(lambda result: result.update({"match": match}[scenario]()), out)


if __name__ == "__main__":
    W.leave(main())
