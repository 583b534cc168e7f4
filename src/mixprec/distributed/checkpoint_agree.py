"""The agreements between ranks that a save and a load make before they change anything (collectives
of ``checkpoint``): the same arguments and path on every rank, the same replicas, and the helpers that
say which rank stopped. Each raises the same ``CheckpointError`` on every rank, at once, instead of
one rank raising alone while the others wait in the next collective until the process group's
timeout and then fail with the transport's words."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixprec.distributed.checkpoint_layout import CheckpointError


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (0, 1) if _no_dist() else (dist.get_rank(), dist.get_world_size())


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if _no_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _peer_gone(rank: int, from_rank0: bool = True) -> str:
    """Who stopped, as a rank can tell when a collective fails: in rank 0's broadcast, rank 0 (on the others);
    otherwise another rank (named when there is only one other)."""
    if rank != 0 and from_rank0:
        return "rank 0 stopped before saying it was done"
    _, world = _rank_world()
    others = [r for r in range(world) if r != rank]
    who = f"rank {others[0]}" if len(others) == 1 else "one of the other ranks"
    return (f"another rank ({who}) stopped before taking part: it died, or raised before this collective (its own "
            "error says why)")


def _require_same_replicas(root: Path, state: dict[str, Any]) -> None:
    """Several ranks, and a model ``mp`` did not prepare with ``parallel=``: DCP writes a plain tensor
    once, rank 0's, taking the ranks to hold the same one. Every plain tensor (and blob) of the model's
    and mixprec's parts of ``state`` they all have is compared bitwise (a digest per entry, one ``all_gather_object``); if they differ,
    every rank raises the same ``CheckpointError`` before anything is written. (Keys that only some
    ranks hold, a pipeline stage's, are their own; DTensors are shards.)"""
    import hashlib

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    # The model's tensors and mixprec's (scale, steps, masters) are compared, not the optimizer's
    # state: replicas that trained apart differ in their weights already, and the optimizer state
    # (two fp32 moments per parameter under Adam) would more than double the bytes read per save.
    flat, _ = flatten_state_dict({k: v for k, v in state.items() if k in ("model", "mixprec")})
    mine: dict[str, str] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and not hasattr(value, "to_local"):
            t = value.detach().cpu().contiguous()
            digest = hashlib.sha1(repr((t.dtype, tuple(t.shape))).encode())
            if t.numel():
                digest.update(t.reshape(-1).view(torch.uint8).numpy())  # (the bytes in place, not a copy)
            mine[key] = digest.hexdigest()
        elif isinstance(value, bytes):
            mine[key] = hashlib.sha1(value).hexdigest()
    gathered = _all_gather(mine)
    differ = sorted(k for k in mine if len({g.get(k, mine[k]) for g in gathered}) > 1)
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise CheckpointError(
            f"saving into {root}: the {len(gathered)} ranks hold different values of {shown}, and a checkpoint keeps "
            "one copy of a replicated tensor (rank 0's): the ranks trained apart (or keep state of their own). "
            "This MixedPrecision did not prepare the model for several ranks: use mp.prepare(model, "
            f"parallel='ddp' or 'fsdp') so that they train one model. Nothing was written: {root}/latest still "
            "names the previous checkpoint")


def _first_line(e: BaseException, limit: int = 400) -> str:
    """The first line of an exception's message, cut at a sentence end when it is long."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else ""
    if len(line) <= limit:
        return line
    end = line.rfind(". ", 0, limit)
    return line[: end + 1] if end > 0 else line[:limit] + "..."


def agree_on_arguments(doing: str, path: Any, checks: Callable[[], Any], nothing: str) -> Any:
    """``checks()`` (the local checks of a save's or load's arguments: types, values) on every rank, and
    the ``path`` every rank was given, agreed in one all-gather before the operation's first collective.
    On one process, or when every rank's checks raised the same error, each rank raises its own error
    (a TypeError stays a TypeError). When the checks raised on some ranks only, or the ranks were given
    different paths, every rank raises the same ``CheckpointError`` naming the ranks (without this, the
    rank that raised left the others waiting in the next collective until the process group's timeout).
    ``doing``: "saving into" or "loading"; ``nothing``: what the message says was left unchanged."""
    if _no_dist():
        return checks()
    value, problem, cause = None, None, None
    try:
        value = checks()
    except Exception as e:  # noqa: BLE001 - said on every rank (re-raised as it is when every rank has it)
        problem, cause = f"{type(e).__name__}: {_first_line(e)}", e
    rank, world = _rank_world()
    try:
        said = _all_gather((problem, str(path)))
    except RuntimeError as e:  # a peer died, or raised before this (a DesyncError: it starts no collective)
        raise CheckpointError(f"{doing} {path}: {_peer_gone(rank, from_rank0=False)} ({_first_line(e)}). "
                              f"{nothing}") from cause
    found = [(r, p) for r, (p, _) in enumerate(said) if p]
    if found and cause is not None and len(found) == world and len({p for _, p in found}) == 1:
        raise cause  # the same mistake on every rank: the error one process gets
    if found:
        ranks = [r for r, _ in found]
        raise CheckpointError(
            f"{doing} {path} was refused on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} before "
            f"any rank started ({'; '.join(f'rank {r}: {p}' for r, p in found)}). Every rank must call it with the "
            f"same (valid) arguments; every rank raises this. {nothing}") from cause
    paths = [p for _, p in said]
    if len(set(paths)) > 1:
        raise CheckpointError(
            f"{doing} a checkpoint: the ranks were given different paths "
            f"({', '.join(f'rank {r}: {p}' for r, p in enumerate(paths))}). "
            "One checkpoint is written and read by every rank together: pass the same path on every rank (a "
            f"directory on a file system every rank sees), not one per rank. {nothing}")
    return value
