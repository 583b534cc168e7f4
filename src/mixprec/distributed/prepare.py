"""``MixedPrecision.prepare(model, parallel=...)``: checks on every rank, one agreement, then DDP or FSDP2.

The order is what keeps a bad input from hanging a job. Before any collective, every rank checks
what it can alone (a process group exists, the model is not wrapped already, the recipe can run
in this mode, the parameters are what the recipe expects) and keeps what it found; then the ranks
exchange those findings and a signature of their setup (recipe, scaler, accumulation, parallel
options, parameter shapes) in one ``all_gather_object``. If any rank found a problem or the
signatures differ, every rank raises the same ``ParallelError``, naming the ranks. Only then are
parameters broadcast and the model wrapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed import fsdp as _fsdp
from mixprec.distributed.config import DDP, FSDP, as_parallel
from mixprec.distributed.ddp import wrap as wrap_ddp
from mixprec.distributed.runtime import Parallel
from mixprec.seam import Local, Plugged
from mixprec.step_io import check_model_params


class ParallelError(ValueError):
    """A distributed setup mixprec refuses; raised on every rank alike, the message says what to do."""


def plug(model: nn.Module, spec: Any, local: Local) -> Plugged:
    """Apply the recipe ``local`` describes to ``model`` and wrap it for ``spec``: the strategy side of
    ``MixedPrecision.prepare(model, parallel=spec)`` (``mixprec.seam``)."""
    cfg = as_parallel(spec)
    group = cfg.process_group if isinstance(cfg, DDP) else None
    _require_process_group(cfg, local.device, group)
    problems = local_problems(local, model, cfg)
    agree(problems, signature(local, model, cfg), group)
    _broadcast_from_rank0(model, group)  # the same starting point everywhere (FSDP2 does not broadcast)
    if isinstance(cfg, DDP):
        wrapped, inner = wrap_ddp(local, model, cfg)
        _share_random_streams(local.masters, group)
        strategy = Parallel(cfg, wrapped, inner, group, accumulate=local.accumulate, device=local.device,
                            masters=local.masters is not None)
        return Plugged(wrapped, strategy, local.masters)
    fp32_rule = local.masters.fp32_params if local.masters is not None else ()
    # the sharded fp32 parameters are the masters (the optimizer steps them): the facade keeps none
    inner = local.apply(model, check_params=False, masters=False)
    if cfg.fp8_all_gather:  # the fp8 layers' weights cross the wire as fp8 bits (mixprec.fp8.fsdp)
        local.fp8_state().enable_fp8_all_gather()
    mesh = cfg.mesh if cfg.mesh is not None else _default_mesh(local.device)
    groups = _fsdp.shard(inner, local.recipe, fp32_rule, cfg, mesh)
    strategy = Parallel(cfg, inner, inner, group, mesh, groups, accumulate=local.accumulate, device=local.device)
    return Plugged(inner, strategy, None)


def _require_process_group(cfg: DDP | FSDP, device: torch.device, group: Any) -> None:
    if not dist.is_available():
        raise ParallelError(f"parallel={cfg.mode!r} needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise ParallelError(
            f"parallel={cfg.mode!r} needs torch.distributed's process group, and none is initialised: call "
            "torch.distributed.init_process_group('nccl' on CUDA, 'gloo' on CPU) on every rank first (under "
            "torchrun it reads RANK, WORLD_SIZE and MASTER_ADDR from the environment), or drop parallel= to "
            "train on one process"
        )
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        raise ParallelError(f"the process group uses nccl, which moves CUDA tensors only, but this MixedPrecision "
                            f"runs on {device}: use device='cuda:LOCAL_RANK', or init_process_group('gloo') for CPU")


def _wrapped_by(model: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel (pass model.module)"
    for name, m in model.named_modules():
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
            return f"FSDP ({type(m).__name__} at {name or 'the root'})"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"DTensor parameters ({name}: sharded or tensor-parallel already)"
    return None


def local_problems(mp: Local, model: nn.Module, cfg: DDP | FSDP) -> list[str]:
    """What this rank finds wrong on its own (raising now would leave the other ranks waiting)."""
    if not isinstance(model, nn.Module):
        return [f"prepare() expects an nn.Module, got {type(model).__name__}"]
    problems = []
    wrapped = _wrapped_by(model)
    if wrapped is not None:
        problems.append(
            f"the model is already wrapped in {wrapped}: give prepare the plain module and let "
            f"parallel={cfg.mode!r} wrap it (the recipe, its fp32 islands and master weights must be applied "
            "before the wrapper, and mixprec chooses the dtype gradients are reduced in)"
        )
    if getattr(model, "_mixprec_recipe", None) is not None:
        problems.append(f"the model was already prepared (recipe {model._mixprec_recipe!r}); prepare a fresh model "
                        f"once, with parallel={cfg.mode!r}")
    if mp.parallel:
        problems.append("this MixedPrecision already trains a distributed model; use one MixedPrecision per model")
    if isinstance(cfg, FSDP):
        why = _fsdp.unsupported(mp.recipe)
        if why:
            problems.append(why)
        if cfg.fp8_all_gather:
            from mixprec.fp8.fsdp import problem  # (a capability's own rule)

            problems += [problem(mp.fp8_spec)] if problem(mp.fp8_spec) else []
        try:
            _fsdp.units(model, cfg.units)
        except ValueError as e:
            problems.append(str(e))
    elif cfg.compress is not None and mp.masters is not None:
        problems.append(f"DDP(compress={cfg.compress!r}) with recipe {mp.recipe.name!r}: a 16-bit storage recipe "
                        "reduces its gradients as fp32 master gradients, after backward; drop compress (or use a "
                        "-mixed recipe, whose fp32 gradients DDP compresses in its buckets)")
    if not problems:
        try:
            check_model_params(model, mp.device, mp.recipe, mp.masters is not None)
        except ValueError as e:
            problems.append(str(e))
    return problems


def signature(mp: Local, model: nn.Module, cfg: DDP | FSDP) -> dict[str, str]:
    """What must be the same on every rank, as strings (so ranks can say how they differ)."""
    scaler = mp.scaler
    scaling = type(scaler).__name__
    if scaler.is_enabled():
        sd = scaler.state_dict()
        scaling += f"(scale={sd['scale']}, growth_interval={sd['growth_interval']}, {sd.get('mixprec', {})})"
    shapes = hashlib.sha1()
    n = count = 0
    if isinstance(model, nn.Module):
        for name, p in model.named_parameters():
            shapes.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
            n += p.numel()
            count += 1
    return {
        "recipe": mp.recipe.name,
        "policy": str(mp.recipe.policy),
        "loss scaler": scaling,
        "accumulate": str(mp.accumulate),
        "fp32_modules": repr([getattr(r, "__name__", r) for r in mp.fp32_modules]),
        "fp8 options": repr(mp.fp8_spec),
        "parallel": _describe(cfg),
        "device type": mp.device.type,
        "model": f"{n:,} parameters in {count} tensors (shapes {shapes.hexdigest()[:12]})",
    }


def _describe(cfg: DDP | FSDP) -> str:
    fields = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("mesh", "process_group") and value is not None:  # objects: compare their shape
            value = tuple(value.shape) if f.name == "mesh" else f"group of {dist.get_world_size(value)}"
        elif f.name == "units" and value is not None:
            value = [getattr(u, "__name__", u) if not callable(u) or isinstance(u, type) else "<predicate>" for u in value]
        fields.append(f"{f.name}={value!r}")
    return f"{cfg.mode}({', '.join(fields)})"


def agree(problems: list[str], sig: dict[str, str], group: Any = None) -> None:
    """One ``all_gather_object`` of every rank's problems and signature; raise on every rank alike."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"problems": problems, "signature": sig}, group=group)
    found = [(r, p) for r, g in enumerate(gathered) for p in g["problems"]]
    if found:
        first = found[0][1]
        ranks = sorted({r for r, p in found if p == first})
        rest = [f"rank {r}: {p}" for r, p in found if p != first]
        raise ParallelError(f"prepare(parallel=...) refused on every rank. Rank{'s' if len(ranks) > 1 else ''} "
                            f"{', '.join(map(str, ranks))}: {first}" + "".join(f"; {x}" for x in rest))
    for key in sig:
        values = [g["signature"][key] for g in gathered]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in by_value.items())
            raise ParallelError(f"the ranks disagree on the {key} ({said}); every rank must build the same "
                                "MixedPrecision and the same model (same recipe, options and parameter shapes)")


def _broadcast_from_rank0(model: nn.Module, group: Any) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def _share_random_streams(masters: Any, group: Any) -> None:
    """Rank 0's random generators for the masters on every rank (stochastic rounding draws its bits
    from them). Every replica rounds the same averaged update, so the bits must be the same: a
    generator seeded from ``torch.initial_seed()`` on ranks seeded ``manual_seed(seed + rank)`` (for
    their dropout) would round each replica its own way, and the replicas would drift apart silently."""
    generators = getattr(masters, "generators", None)
    if not generators:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    mine = [generators[key] for key in sorted(generators)]  # (by order: cuda:0 on rank 0 is cuda:1 on rank 1)
    states = [[g.get_state() for g in mine]]
    dist.broadcast_object_list(states, src=src, group=group)
    if len(states[0]) != len(mine):  # (the ranks agreed on the recipe and the device type: not expected)
        raise ParallelError(f"rank 0 rounds stochastically with {len(states[0])} random generator(s) and this rank "
                            f"with {len(mine)}: give every rank one device of the same kind")
    for g, state in zip(mine, states[0]):
        g.set_state(state)


def _default_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))
