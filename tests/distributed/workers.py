"""One rank of the distributed tests: ``python workers.py SCENARIO[,SCENARIO...] OUT [ARGS...]``.

Started by ``dist_helpers.spawn`` with RANK, WORLD_SIZE and MIXPREC_DIST_INIT (a FileStore) in the
environment; writes ``OUT/rank{RANK}.json``: one entry per scenario, observations only (the tests
judge them). The model is the built-in char GPT, small (d_model 32, two blocks); a step's global
batch is ``2 * WORLD`` sequences, each rank training on its ``2`` (``micro``); the one-process
reference trains on the same global batch as ``WORLD`` accumulated micro-batches in rank order.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import mixprec  # noqa: E402
from mixprec.distributed import DDP, FSDP, load_checkpoint, save_checkpoint  # noqa: E402
from mixprec.tasks import charlm  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TASK = charlm.make_task(batch_size=2 * WORLD, seq_len=16, d_model=32, n_layer=2, n_head=4)
RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")


def micro(step: int, k: int, n: int = WORLD):
    x, y = TASK.get_batch(step)
    return x.chunk(n)[k], y.chunk(n)[k]


def build(recipe, parallel=None, *, seed=0, scaler=None, opt="adamw", lr=1e-2):
    torch.manual_seed(seed)
    model = TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", accumulate=1 if parallel else WORLD, scaler=scaler)
    model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    params = mp.parameters(model)
    optimizer = torch.optim.AdamW(params, lr=lr) if opt == "adamw" else torch.optim.SGD(params, lr=lr)
    return mp, model, optimizer


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def params(mp, model) -> dict[str, torch.Tensor]:
    """name -> the full fp32 value the optimizer steps (a master for 16-bit storage recipes)."""
    return {n.removeprefix("module."): full(p) for n, p in mp.named_parameters(model)}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def max_diff(a, b) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def record(stats, parallel=True) -> dict:
    """A step's stats as plain values; under ``parallel`` the loss averaged over the ranks (a collective)."""
    loss = stats.loss.detach().clone()
    if parallel and stats.stepped:
        dist.all_reduce(loss)
        loss /= WORLD
    return {"loss": float(loss), "scale": float(stats.scale), "skipped": bool(stats.skipped),
            "grad_norm": None if stats.grad_norm is None else float(stats.grad_norm)}


def train(mp, model, opt, steps, parallel, *, start=0, clip=100.0):
    """``steps`` optimizer steps; under ``parallel`` each rank its micro-batch, else all of them accumulated."""
    out = []
    for step in range(start, start + steps):
        for k in ([RANK] if parallel else range(WORLD)):
            x, y = micro(step, k)
            with mp.autocast():
                logits = model(x)
            stats = mp.step(charlm.lm_loss(logits, y), opt, max_grad_norm=clip)
        out.append(record(stats, bool(parallel)))
    return out


_REFS: dict = {}


def reference(recipe, steps, clip, opt="adamw", lr=1e-2):
    key = (recipe, steps, clip, opt, lr)
    if key not in _REFS:
        mp, model, o = build(recipe, opt=opt, lr=lr)
        stats = train(mp, model, o, steps, None, clip=clip)
        _REFS[key] = (params(mp, model), stats)
    return _REFS[key]


# ---------------------------------------------------------------------------- scenarios


def scenario_match():
    """Each recipe under DDP and FSDP2 against one process on the same global batch."""
    out = {}
    for mode in ("ddp", "fsdp"):
        for recipe in RECIPES:
            ref, ref_stats = reference(recipe, 3, 100.0)
            mp, model, opt = build(recipe, mode)
            stats = train(mp, model, opt, 3, mode)
            got = params(mp, model)
            if mode == "fsdp":
                out[f"groups/{recipe}"] = mp._dist.fsdp_groups
            out[f"{mode}/{recipe}"] = {"digest": digest(got), "ref_digest": digest(ref), "max_diff": max_diff(got, ref),
                                       "stats": stats, "ref_stats": ref_stats,
                                       "local_digest": digest({n: p.detach().float() for n, p in model.named_parameters()}
                                                              if mode == "ddp" else {})}
    # clipping active (the norm is ~0.9; clip at 0.5), one SGD step: the clip coefficient shows in the update
    torch.manual_seed(0)
    init = {n: p.detach().float() for n, p in TASK.build_model().named_parameters()}
    for mode in ("ddp", "fsdp"):
        ref, ref_stats = reference("bf16-mixed", 1, 0.5, "sgd", 0.5)
        mp, model, opt = build("bf16-mixed", mode, opt="sgd", lr=0.5)
        stats = train(mp, model, opt, 1, mode, clip=0.5)
        got = params(mp, model)
        out[f"clip/{mode}"] = {"digest": digest(got), "ref_digest": digest(ref), "stats": stats, "ref_stats": ref_stats,
                               **_clip_bound(got, ref, init)}
    return out


def _clip_bound(got, ref, init):
    """How far the clipped update may move when the norm is summed in another order (FSDP2: per shard,
    then over the ranks). The norm is a square root of a sum of squares: summed in any order, its
    relative error is at most gamma_m = m u / (1 - m u) for the m terms of the longest sum (the
    largest tensor's elements, then the tensors' norms) plus a few roundings (the square roots,
    the all-reduce): delta = 2 (n_max + n_tensors + 8) u, u = 2**-24. The clip coefficient
    max_norm / (norm + 1e-6) inherits it, the update lr * coef * g moves by |update| * delta, and
    each run rounds p - update once more (half an ulp of p each). Returns the bound's parts and
    the largest |got - ref| / bound over all elements."""
    u = 2.0**-24
    n_max, n_tensors = max(t.numel() for t in ref.values()), len(ref)
    delta = 2 * (n_max + n_tensors + 8) * u
    worst = 0.0
    for n in ref:
        bound = (ref[n] - init[n]).abs() * delta + ref[n].abs() * 2 * u + 1e-30
        worst = max(worst, float(((got[n] - ref[n]).abs() / bound).max()))
    return {"delta": delta, "worst": worst}


def _parts_step(mp, model, opt, step, *, poison=None, clip=1.0):
    """One step through the public parts, with ``poison(model)`` applied to the gradients after
    backward (on this rank only, when given): how an inf in one rank's shard is made."""
    x, y = micro(step, RANK) if mp._dist is not None else micro(step, 0, 1)
    with mp.autocast():
        logits = model(x)
    loss = charlm.lm_loss(logits, y)
    mp.scaler.scale(loss).backward()
    if poison is not None:
        with torch.no_grad():
            poison(model)
    mp.after_backward(opt)
    mp.unscale_(opt)
    norm = mp.clip_grad_norm_(opt, clip)
    return record(mp.optimizer_step(opt, loss=loss.detach(), grad_norm=norm), mp._dist is not None)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _inf_in_my_shard(name, value=float("inf")):
    def poison(model):
        g = _local(dict(model.named_parameters())[name].grad)
        g.view(-1)[0] = value
    return poison


def _snapshot(model, opt):
    ps = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    st = {f"{i}.{k}": _local(v).detach().clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
          if torch.is_tensor(v)}
    return ps, st


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def scenario_skip():
    """fp16-mixed: an inf on one rank only. FSDP2: in rank 1's own shard (after the reduce-scatter:
    rank 0's shards stay finite). DDP: in rank 1's loss (the all-reduce carries it)."""
    out = {}
    mp, model, opt = build("fp16-mixed", "fsdp")
    out["fsdp_clean"] = _parts_step(mp, model, opt, 0)
    before = _snapshot(model, opt)
    poison = _inf_in_my_shard("head.weight") if RANK == 1 else None
    out["fsdp_inf"] = _parts_step(mp, model, opt, 1, poison=poison)
    after = _snapshot(model, opt)
    out["fsdp_unchanged"] = _same(before[0], after[0]) and _same(before[1], after[1])
    out["fsdp_scale_after"] = mp.scaler.get_scale()
    out["fsdp_scaler_state"] = mp.scaler.state_dict()
    out["fsdp_next"] = _parts_step(mp, model, opt, 2)  # training goes on
    out["fsdp_digest"] = digest(params(mp, model))

    mp, model, opt = build("fp16-mixed", "ddp")
    train(mp, model, opt, 1, "ddp")
    before = _snapshot(model, opt)
    x, y = micro(1, RANK)
    with mp.autocast():
        logits = model(x)
    loss = charlm.lm_loss(logits, y) * (1e30 if RANK == 1 else 1.0)  # overflows fp16 in rank 1's backward
    out["ddp_inf"] = record(mp.step(loss, opt, max_grad_norm=1.0))
    out["ddp_unchanged"] = _same(before[0], _snapshot(model, opt)[0])
    out["ddp_scale_after"] = mp.scaler.get_scale()
    out["ddp_digest"] = digest(params(mp, model))

    # a parameter the optimizer holds beside the wrapped model (a plain tensor, not a DTensor: torch's
    # DTensor unscale kernel MAX-reduces the flag of sharded gradients itself, but not of this one)
    for mode in ("fsdp", "ddp"):
        mp, model, opt = build("fp16-mixed", mode)
        extra = torch.nn.Parameter(torch.ones(3))
        opt.add_param_group({"params": [extra]})

        def poison(model, extra=extra):
            extra.grad = torch.full((3,), float("inf") if RANK == 1 else 1.0)
        _parts_step(mp, model, opt, 0)
        before = _snapshot(model, opt)
        out[f"{mode}_extra"] = _parts_step(mp, model, opt, 1, poison=poison)
        out[f"{mode}_extra_unchanged"] = _same(before[0], _snapshot(model, opt)[0])
        out[f"{mode}_extra_scale_after"] = mp.scaler.get_scale()

    # hysteresis and the floor as on one process: overflows at steps 1, 2 and 3 in rank 1's shard
    for name, scaler in (("hysteresis", {"hysteresis": 2}), ("floor", {"init_scale": 2.0**16, "min_scale": 2.0**15,
                                                                       "on_floor": "skip"})):
        seq = {}
        for where in ("fsdp", "one"):
            if where == "one" and RANK != 0:
                continue
            m, mod, o = build("fp16-mixed", "fsdp" if where == "fsdp" else None, scaler=scaler)
            if where == "one":
                m.accumulate = 1  # one process, one micro-batch: only the skip decisions are compared
            steps = []
            for step in range(5):
                hit = step in (1, 2, 3) and (RANK == 1 or where == "one")
                steps.append(_parts_step(m, mod, o, step, poison=_inf_in_my_shard("head.weight") if hit else None))
                steps[-1]["scale_after"] = m.scaler.get_scale()
                steps[-1]["state"] = m.scaler.state_dict()["mixprec"]
            seq[where] = steps
        out[name] = seq
    return out


def scenario_clip():
    """bf16-mixed under FSDP2: a large gradient, then a NaN, in rank 1's shard only."""
    out = {}
    for label, value in (("large", 1e4), ("nan", float("nan"))):
        mp, model, opt = build("bf16-mixed", "fsdp", opt="sgd", lr=0.1)
        x, y = micro(0, RANK)
        with mp.autocast():
            logits = model(x)
        mp.scaler.scale(charlm.lm_loss(logits, y)).backward()
        named = dict(model.named_parameters())
        if RANK == 1:
            _local(named["head.weight"].grad).view(-1)[0] = value
        shards = {n: float(_local(p.grad).double().norm()) for n, p in named.items()}
        mine_sq = sum(v * v for v in shards.values())
        mp.after_backward(opt)
        mp.unscale_(opt)
        tok = _local(named["tok.weight"].grad).clone()
        norm = mp.clip_grad_norm_(opt, 1.0)
        ratio = float((_local(named["tok.weight"].grad).double().norm() / tok.double().norm()))
        out[label] = {"norm": float(norm), "norm_is_tensor": type(norm).__name__, "local_sq": mine_sq, "ratio": ratio}
    return out


def _ckpt_state(mp, model, opt):
    names = {id(p): n for n, p in mp.named_parameters(model)}
    state = {f"{names[id(p)]}.{k}": full(v) for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)}
    return {"params": digest(params(mp, model)), "optimizer": digest(state), "steps": mp._steps,
            "scaler": mp.scaler.state_dict()}


CKPT_CASES = (("fsdp", "fp16-mixed"), ("fsdp", "bf16-true"), ("ddp", "bf16-true"), ("ddp", "fp16-mixed"))
GROWING = {"init_scale": 2.0**8, "growth_interval": 2}  # the scale changes within the test


def scenario_checkpoint():
    """Train 2 steps, save, 2 more; a fresh run (another seed) loads and trains the same 2: bitwise?"""
    out_dir = Path(sys.argv[2])
    out = {}
    for mode, recipe in CKPT_CASES:
        scaler = GROWING if recipe.startswith("fp16") else None
        mp, model, opt = build(recipe, mode, scaler=scaler)
        train(mp, model, opt, 2, mode)
        path = out_dir / f"ckpt-{mode}-{recipe}"
        save_checkpoint(path, model=model, optimizer=opt, mp=mp)
        saved = _ckpt_state(mp, model, opt)
        cont = train(mp, model, opt, 2, mode, start=2)
        first = _ckpt_state(mp, model, opt)
        mp2, model2, opt2 = build(recipe, mode, seed=1234, scaler=scaler)
        load_checkpoint(path, model=model2, optimizer=opt2, mp=mp2)
        loaded = _ckpt_state(mp2, model2, opt2)
        resumed = train(mp2, model2, opt2, 2, mode, start=2)
        out[f"{mode}/{recipe}"] = {"saved": saved, "loaded": loaded, "uninterrupted": first,
                                   "resumed_state": _ckpt_state(mp2, model2, opt2), "cont": cont, "resumed": resumed,
                                   "path": str(path)}
    return out


def scenario_reshard():
    """On another world size: load the checkpoints a 2-rank run saved (paths in argv[3])."""
    src = Path(sys.argv[3])
    out = {}
    for mode, recipe in (("fsdp", "fp16-mixed"), ("ddp", "bf16-true")):
        mp, model, opt = build(recipe, mode, seed=99, scaler=GROWING if recipe.startswith("fp16") else None)
        load_checkpoint(src / f"ckpt-{mode}-{recipe}", model=model, optimizer=opt, mp=mp)
        out[f"{mode}/{recipe}"] = {"loaded": _ckpt_state(mp, model, opt), "next": train(mp, model, opt, 1, mode, start=2),
                                   "digest_after": digest(params(mp, model))}
    # a checkpoint whose optimizer state cannot go into this layout: refused, on every rank
    mp, model, opt = build("bf16-true", "fsdp", seed=99)
    try:
        load_checkpoint(src / "ckpt-ddp-bf16-true", model=model, optimizer=opt, mp=mp)
        out["cross"] = None
    except Exception as e:
        out["cross"] = f"{type(e).__name__}: {e}"
    return out


def _attempt(fn):
    try:
        fn()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def scenario_bad():
    """Bad input: each a clear error on every rank, and the group still works afterwards."""
    from torch.nn.parallel import DistributedDataParallel

    def prepare(recipe, parallel, model=None):
        mp = mixprec.MixedPrecision(recipe, "cpu")
        torch.manual_seed(0)
        return mp.prepare(model if model is not None else TASK.build_model(), parallel=parallel)

    out = {
        "recipes_differ": _attempt(lambda: prepare("bf16-mixed" if RANK == 0 else "fp16-mixed", "ddp")),
        "wrapped": _attempt(lambda: prepare("bf16-mixed", "ddp", DistributedDataParallel(TASK.build_model()))),
        "kahan_fsdp": _attempt(lambda: prepare("bf16-true-kahan", "fsdp")),
        "pure_fsdp": _attempt(lambda: prepare("fp16-pure", "fsdp")),
        "compress_true": _attempt(lambda: prepare("bf16-true", DDP(compress="bf16"))),
        "one_rank_prepared": _attempt(lambda: prepare(
            "bf16-mixed", "fsdp", mixprec.MixedPrecision("bf16-mixed", "cpu").prepare(TASK.build_model())
            if RANK == 1 else None)),
        "units_typo": _attempt(lambda: prepare("bf16-mixed", FSDP(units=["blockz"]))),
    }
    mp, model, opt = build("fp16-mixed", "fsdp")  # after all that, the ranks still agree and train
    out["then_trains"] = train(mp, model, opt, 1, "fsdp")
    return out


def scenario_compress():
    """DDP(compress=...) on gloo, one SGD step (lr 1): the update differs from the fp32-reduced one by
    the wire's rounding. Each rank's bucket is rounded to the wire dtype (unit roundoff u: 2**-8 bf16,
    2**-11 fp16), divided by 2 (exact), summed on the wire (one more rounding of the sum), copied
    back: per tensor ||g_wire - g|| <= u (||g0|| + ||g1||) / 2 + u (1 + u) ||g|| + 2 u32 ||g||, plus
    fp16's subnormal range (absolute 2**-25 per element, three roundings) and half an ulp of each
    parameter for the update's own rounding. ``worst`` is the largest ratio of the difference to it."""
    out = {}
    ref, _ = reference("bf16-mixed", 1, 100.0, "sgd", 1.0)
    torch.manual_seed(0)
    init = {n: p.detach().float() for n, p in TASK.build_model().named_parameters()}
    # each rank's own gradient, on one process (the same numbers a rank computes)
    local = []
    for k in range(WORLD):
        mp, model, _ = build("bf16-mixed", opt="sgd")
        x, y = micro(0, k)
        with mp.autocast():
            logits = model(x)
        charlm.lm_loss(logits, y).backward()
        local.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    u32 = 2.0**-24
    for wire, u in (("bf16", 2.0**-8), ("fp16", 2.0**-11)):
        mp, model, opt = build("bf16-mixed", DDP(compress=wire), opt="sgd", lr=1.0)
        stats = train(mp, model, opt, 1, "ddp")
        got = params(mp, model)
        worst = 0.0
        for n in got:
            g = init[n] - ref[n]  # lr 1: the update is the averaged gradient
            subnormal = 3 * 2.0**-25 * g.numel() ** 0.5 if wire == "fp16" else 0.0
            bound = (u * sum(float(loc[n].norm()) for loc in local) / WORLD + (u * (1 + u) + 2 * u32) * float(g.norm())
                     + subnormal + u32 * float(ref[n].norm()) + 1e-30)
            worst = max(worst, float((got[n] - ref[n]).norm()) / bound)
        out[wire] = {"worst": worst, "differs": digest(got) != digest(ref), "stats": stats}
    return out


def scenario_memory():
    from mixprec.memory.measure import measure_parallel_step

    out = {}
    for mode in ("fsdp", "ddp"):
        for recipe in ("bf16-mixed", "bf16-true"):
            m = measure_parallel_step(TASK, recipe, mode)
            out[f"{mode}/{recipe}"] = m.to_dict()
    return out


def rank_main(body, out_dir: Path, timeout_s: float = 60.0) -> int:
    """One rank of a test, from its process group to its teardown: ``body(result)`` fills the
    ``result`` dict (what it filled survives an exception, whose traceback is added as "error"),
    written to ``out_dir/rank{RANK}.json``; returns the exit code. Every gloo worker goes through
    here: no rank tears its group down while another still has work in flight (gloo aborts it)."""
    dist.init_process_group("gloo", init_method=os.environ["MIXPREC_DIST_INIT"], rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))
    result: dict = {}
    try:
        body(result)
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(result, allow_nan=True))
    if "error" not in result:
        dist.barrier()
    dist.destroy_process_group()
    return 1 if "error" in result else 0


def leave(code: int) -> None:
    """Exit without the interpreter's teardown: with gloo, worker threads that still hold finished
    work objects abort the process while Python finalises ("terminate called without an active
    exception", now and then; seen on torch 2.13 CPU). The results are written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> int:
    scenarios, out_dir = sys.argv[1].split(","), Path(sys.argv[2])

    def body(result: dict) -> None:
        for name in scenarios:
            result[name] = globals()[f"scenario_{name}"]()

    return rank_main(body, out_dir)


if __name__ == "__main__":
    leave(main())
