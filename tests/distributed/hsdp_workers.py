"""One rank of the HSDP tests: ``python hsdp_workers.py OUT`` on 4 ranks, a 2 x 2 mesh (replicate x shard).

Rank r sits at (r // 2, r % 2): ranks 0 and 2 hold the same shards (one replica each), 1 and 3 the
others. FSDP2 reduce-scatters within a shard group and all-reduces across the replicas. Each rank
writes: one SGD step of bf16-mixed against one process on the same global batch (4 micro-batches
accumulated in rank order), with each micro-batch's own gradient for the bound; its shards after 2
AdamW steps of bf16-true; an inf in rank 3's shard under fp16-mixed; an optimizer step that raises
on rank 3 only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import workers as W  # noqa: E402  (the model and batches: 2 sequences per rank, digests)

import mixprec  # noqa: E402
from mixprec.distributed import FSDP  # noqa: E402
from mixprec.tasks import charlm  # noqa: E402

RANK, WORLD = W.RANK, W.WORLD


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))


def build(recipe, parallel, *, opt="sgd", lr=1.0, accumulate=1, scaler=None):
    torch.manual_seed(0)
    model = W.TASK.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", accumulate=accumulate, scaler=scaler)
    model = mp.prepare(model, parallel=parallel) if parallel is not None else mp.prepare(model)
    params = mp.parameters(model)
    o = torch.optim.SGD(params, lr=lr) if opt == "sgd" else torch.optim.AdamW(params, lr=1e-2)
    return mp, model, o


def one_step(mp, model, opt, ks):
    for k in ks:
        x, y = W.micro(0, k)
        with mp.autocast():
            logits = model(x)
        stats = mp.step(charlm.lm_loss(logits, y), opt)
    return stats


def scenario_match(mesh):
    mp, model, opt = build("bf16-mixed", FSDP(mesh=mesh))
    one_step(mp, model, opt, [RANK])
    got = W.params(mp, model)
    ref_mp, ref_model, ref_opt = build("bf16-mixed", None, accumulate=WORLD)
    one_step(ref_mp, ref_model, ref_opt, range(WORLD))
    ref = W.params(ref_mp, ref_model)
    # each micro-batch's own gradient (what rank k computes), for the bound on the order of the sum
    sums = {n: torch.zeros_like(t) for n, t in ref.items()}
    for k in range(WORLD):
        m1, model1, _ = build("bf16-mixed", None)
        x, y = W.micro(0, k)
        with m1.autocast():
            logits = model1(x)
        charlm.lm_loss(logits, y).backward()
        for n, p in model1.named_parameters():
            sums[n] += p.grad.detach().abs() / WORLD
    # the gradient is a sum of WORLD terms g_k / WORLD: FSDP2 adds them in pairs (the shard group, then
    # the replicas), one process in rank order. Two orders differ by <= 2 gamma_(WORLD-1) sum|terms|;
    # the SGD update p - g (lr 1) rounds once on each side (half an ulp of p each)
    u = 2.0**-24
    gamma = (WORLD - 1) * u / (1 - (WORLD - 1) * u)
    worst, differ = 0.0, 0
    for n in ref:
        bound = 2 * gamma * sums[n] + 2 * u * ref[n].abs() + 1e-30
        worst = max(worst, float(((got[n] - ref[n]).abs() / bound).max()))
        differ += int((got[n] != ref[n]).sum())
    return {"worst": worst, "differ": differ, "digest": W.digest(got), "steps": mp._steps}


def _local_digest(model):
    return W.digest({n: W._local(p).detach().float() for n, p in model.named_parameters()})


def scenario_replicas(mesh):
    mp, model, opt = build("bf16-true", FSDP(mesh=mesh), opt="adamw")
    for step in range(2):
        x, y = W.micro(step, RANK)
        with mp.autocast():
            logits = model(x)
        mp.step(charlm.lm_loss(logits, y), opt, max_grad_norm=1.0)
    state = {f"{i}.{k}": W._local(v).detach().clone() for i, s in enumerate(opt.state.values())
             for k, v in s.items() if torch.is_tensor(v)}
    return {"local": _local_digest(model), "optimizer": W.digest(state), "steps": mp._steps}


def scenario_skip(mesh):
    mp, model, opt = build("fp16-mixed", FSDP(mesh=mesh), opt="adamw")
    poison = W._inf_in_my_shard("head.weight") if RANK == 3 else None
    first = W._parts_step(mp, model, opt, 0)
    before = W._snapshot(model, opt)
    hit = W._parts_step(mp, model, opt, 1, poison=poison)
    after = W._snapshot(model, opt)
    return {"first": first["skipped"], "hit": hit["skipped"], "unchanged": W._same(before[0], after[0]),
            "scale": mp.scaler.get_scale(), "state": mp.scaler.state_dict()["mixprec"]}


def scenario_desync(mesh):
    mp, model, opt = build("bf16-mixed", FSDP(mesh=mesh), opt="adamw")
    events = []
    for step in range(3):
        try:
            if step == 1 and RANK == 3:
                step_fn = opt.step
                opt.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom on rank 3"))
            x, y = W.micro(step, RANK)
            with mp.autocast():
                logits = model(x)
            mp.step(charlm.lm_loss(logits, y), opt)
            events.append("ok")
        except Exception as e:  # noqa: BLE001 - every rank carries on
            events.append(f"{type(e).__name__}: {e}"[:300])
        finally:
            if step == 1 and RANK == 3:
                opt.step = step_fn
    return {"events": events}


def main() -> int:
    def body(result: dict) -> None:
        mesh = _mesh()
        result["coords"] = [int(c) for c in mesh.get_coordinate()]
        for name in ("match", "replicas", "skip", "desync"):
            result[name] = globals()[f"scenario_{name}"](mesh)

    return W.rank_main(body, Path(sys.argv[1]), timeout_s=120)


if __name__ == "__main__":
    W.leave(main())
