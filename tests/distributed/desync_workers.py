"""One rank of the desync tests: ``python desync_workers.py SCENARIO[,SCENARIO...] OUT``.

Each scenario trains the small char GPT of ``workers.py`` on 2 ranks and makes one rank's step
raise once (or a rank die or stop), then goes on the way a user's loop does: every rank catches
its exception (``mp.reset()`` after an exception outside ``step``, as documented), and carries on.
A rank writes what each micro-step gave (``ok`` or the exception) and where it ended (step count,
scheduler epoch, digests of its parameters) to ``OUT/rank{RANK}.json``; the tests judge.

Scenarios that leave the ranks unable to pair their collectives run on a process group of their own
with a short timeout (``FAULT_TIMEOUT``), so that the default group stays usable for the next.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import workers as W  # noqa: E402  (the model, the batches, the digests)

import mixprec  # noqa: E402
from mixprec.distributed import DDP, FSDP, load_checkpoint, save_checkpoint  # noqa: E402
from mixprec.tasks import charlm  # noqa: E402

RANK, WORLD = W.RANK, W.WORLD
FAULT_TIMEOUT = float(os.environ.get("MIXPREC_FAULT_TIMEOUT", "4"))


class Boom(Exception):
    """The injected exception."""


ARMED = {"on": False, "fire": None}


class Schedule(torch.optim.lr_scheduler.StepLR):
    """StepLR (halving every step) whose step can be made to raise (``ARMED``: not in its state dict)."""

    def step(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if ARMED["fire"] is not None and ARMED["point"] == "sched":
            ARMED["fire"]()
        return super().step(*args, **kwargs)


#: name -> (mode, recipe, accumulate, point, ranks that raise, (step, micro) it happens at, steps, own group)
SCENARIOS = {
    # the collectives stay paired: a DesyncError on every rank, then (sticky) a checkpoint brings them back
    "ddp_opt": ("ddp", "fp16-mixed", 1, "opt", (1,), (1, 0), 4, False),
    "fsdp_opt": ("fsdp", "bf16-mixed", 1, "opt", (1,), (1, 0), 4, False),
    "ddp_sched": ("ddp", "bf16-mixed", 1, "sched", (1,), (1, 0), 4, False),
    "fsdp_sched": ("fsdp", "fp16-mixed", 1, "sched", (1,), (1, 0), 4, False),
    # every rank raises at the same point: discarded alike, as on one process; training goes on
    "ddp_opt_all": ("ddp", "bf16-mixed", 1, "opt", (0, 1), (1, 0), 3, False),
    "fsdp_opt_all": ("fsdp", "bf16-mixed", 1, "opt", (0, 1), (1, 0), 3, False),
    # a window discarded before any communication: DesyncError once, on every rank; then it goes on
    "ddp_forward": ("ddp", "bf16-mixed", 1, "forward", (1,), (1, 0), 4, False),
    "ddp_window": ("ddp", "bf16-true", 2, "loss_hook", (1,), (1, 0), 4, False),
    "fsdp_reset_between": ("fsdp", "bf16-mixed", 2, "reset_between", (1,), (1, 0), 4, False),
    # the rank left the others inside a collective: a clear error on every rank, nothing trains on
    "ddp_loss_hook": ("ddp", "bf16-mixed", 1, "loss_hook", (1,), (1, 0), 3, True),
    "ddp_mid_backward": ("ddp", "fp16-mixed", 1, "mid_backward", (1,), (1, 0), 3, True),
    "fsdp_loss_hook": ("fsdp", "bf16-mixed", 1, "loss_hook", (1,), (1, 0), 3, True),
    "fsdp_mid_backward": ("fsdp", "bf16-true", 1, "mid_backward", (1,), (1, 0), 3, True),
    "fsdp_forward": ("fsdp", "bf16-mixed", 1, "forward", (1,), (1, 0), 3, True),
    # ... on every rank at once: no rank waits for a timeout, every rank raises at once from then on
    "fsdp_mid_backward_all": ("fsdp", "bf16-mixed", 1, "mid_backward", (0, 1), (1, 0), 3, True),
    # one rank dies (uncaught, SIGKILL) or stops (SIGSTOP): run alone, on the default group
    "ddp_uncaught": ("ddp", "bf16-mixed", 1, "uncaught", (1,), (1, 0), 4, False),
    "fsdp_kill": ("fsdp", "bf16-mixed", 1, "kill", (1,), (1, 0), 3, False),
    "ddp_stop": ("ddp", "bf16-mixed", 1, "stop", (1,), (1, 0), 3, False),
}
RECOVER = {"ddp_opt", "fsdp_opt", "ddp_sched", "fsdp_sched"}  # load the step-0 checkpoint after the errors


def _build(mode, recipe, accumulate, group):
    torch.manual_seed(0)
    model = W.TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", accumulate=accumulate)
    if group is None:
        spec = mode
    elif mode == "ddp":
        spec = DDP(process_group=group)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        spec = FSDP(mesh=DeviceMesh.from_group(group, "cpu"))
    model = mp.prepare(model, parallel=spec)
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    sched = Schedule(opt, step_size=1, gamma=0.5)
    return mp, model, opt, sched


def _batch(step, micro, k):
    """This rank's micro-batch ``micro`` of step ``step`` (the global batch split over ranks x micro-steps)."""
    x, y = W.TASK.get_batch(step)
    n = WORLD * k
    return x.chunk(n)[RANK * k + micro], y.chunk(n)[RANK * k + micro]


def _local_digest(model):
    return W.digest({n: W._local(p).detach().float() for n, p in model.named_parameters()})


def _say(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000], "notes": list(getattr(e, "__notes__", []))}


def run_scenario(name, out_dir):
    mode, recipe, k, point, ranks, (at_step, at_micro), steps, own = SCENARIOS[name]
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FAULT_TIMEOUT)) if own else None
    mp, model, opt, sched = _build(mode, recipe, k, group)
    local = model.module if mode == "ddp" else model
    armed = {"on": False}

    def fire():
        if armed["on"]:
            armed["on"] = False
            if point == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if point == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise Boom(f"{point} on rank {RANK}")

    if point in ("opt", "uncaught"):
        step_fn = opt.step
        opt.step = lambda *a, **kw: (fire(), step_fn(*a, **kw))[1]
    ARMED.update(fire=fire, point=point)
    if point == "mid_backward":
        local.blocks[0].register_full_backward_hook(lambda m, gi, go: fire())
    if point == "forward":
        local.blocks[1].register_forward_hook(lambda m, i, o: fire())
    ckpt = Path(out_dir) / f"ckpt-{name}"
    events = []
    for step in range(steps):
        for m in range(k):
            armed["on"] = RANK in ranks and (step, m) == (at_step, at_micro) and point != "reset_between"
            ev = {"step": step, "micro": m}
            try:
                x, y = _batch(step, m, k)
                with mp.autocast():
                    logits = model(x)
                loss = charlm.lm_loss(logits, y)
                if point in ("loss_hook", "kill", "stop"):
                    loss.register_hook(lambda g: (fire(), g)[1])
                stats = mp.step(loss, opt, scheduler=sched)
                ev["ok"] = bool(stats.stepped)
            except Boom as e:
                if point == "uncaught":
                    raise
                mp.reset()  # (after step's own reset: a no-op; after a forward: what the docs ask)
                ev.update(_say(e))
            except Exception as e:  # noqa: BLE001 - a user's loop that carries on
                mp.reset()
                ev.update(_say(e))
            events.append(ev)
            if point == "reset_between" and RANK in ranks and (step, m) == (at_step, at_micro):
                mp.reset()  # between micro-steps, no exception: this rank drops its window's first half
        if step == 0 and name in RECOVER:
            save_checkpoint(ckpt, model=model, optimizer=opt, mp=mp, scheduler=sched)
    result = {"events": events, "steps": mp._steps, "epoch": sched.last_epoch, "local": _local_digest(model)}
    broken = any("DesyncError" in e.get("error", "") and "cannot be paired again" in e.get("error", "") for e in events)
    if not broken and point not in ("kill", "stop", "uncaught"):
        result["digest"] = W.digest(W.params(mp, model))  # (FSDP: a collective; the group is paired)
    if broken:  # a broken rank writes no checkpoint: save_checkpoint starts with mp.state_dict()
        try:
            mp.state_dict()
            result["state_dict"] = "ok"
        except Exception as e:  # noqa: BLE001
            result["state_dict"] = f"{type(e).__name__}: {e}"[:200]
    if name in RECOVER:  # every rank loads the checkpoint of step 0 and trains steps 1 and 2 again
        try:  # refused on every rank before anything is written: latest stays the step-0 checkpoint loaded below
            save_checkpoint(ckpt, model=model, optimizer=opt, mp=mp, scheduler=sched)
            result["saveable"] = "ok"
        except Exception as e:  # noqa: BLE001
            result["saveable"] = f"{type(e).__name__}: {e}"[:200]
        load_checkpoint(ckpt, model=model, optimizer=opt, mp=mp, scheduler=sched)
        after = []
        for step in (1, 2):
            x, y = _batch(step, 0, 1)
            with mp.autocast():
                logits = model(x)
            after.append(bool(mp.step(charlm.lm_loss(logits, y), opt, scheduler=sched).stepped))
        # the uninterrupted run: steps 0, 1, 2
        mp2, model2, opt2, sched2 = _build(mode, recipe, 1, None)
        for step in range(3):
            x, y = _batch(step, 0, 1)
            with mp2.autocast():
                logits = model2(x)
            mp2.step(charlm.lm_loss(logits, y), opt2, scheduler=sched2)
        mp._dist.require_consistent()  # (loaded: consistent again)
        result["recovered"] = {"stepped": after, "digest": W.digest(W.params(mp, model)), "steps": mp._steps,
                               "epoch": sched.last_epoch, "local": _local_digest(model),
                               "uninterrupted": W.digest(W.params(mp2, model2)), "uninterrupted_steps": mp2._steps,
                               "uninterrupted_epoch": sched2.last_epoch}
    return result


def main() -> int:
    names, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    timeout = FAULT_TIMEOUT if any(SCENARIOS[n][3] in ("kill", "stop", "uncaught") for n in names) else 60
    dist.init_process_group("gloo", init_method=os.environ["MIXPREC_DIST_INIT"], rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout))
    result = {}
    try:
        for name in names:
            print(f"scenario {name}", flush=True)
            result[name] = run_scenario(name, out_dir)
    except Boom:
        raise  # (the uncaught scenario: this rank dies)
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (see workers.py: no interpreter teardown with gloo threads around)
