"""``save_checkpoint`` / ``load_checkpoint``: the model, the optimizer(s) and everything mixprec holds
(the loss scaler, master weights, step counters), through ``torch.distributed.checkpoint`` (DCP).

Every rank calls them, at the same point (they are collectives); on one process they work alike
(DCP without a process group). What is written, one DCP checkpoint directory:

- ``model``: ``get_model_state_dict`` (FSDP2: each rank writes its shards; DDP: rank 0 writes the
  replicated tensors once);
- ``optimizer``: ``get_optimizer_state_dict``, keyed by parameter names (sharded like the
  parameters under FSDP2), so DCP can reshard it for another world size. A 16-bit storage recipe
  outside FSDP2 builds its optimizer over fp32 masters the model does not hold; its optimizer
  state (replicated on every rank) is written as one serialized blob instead;
- ``mixprec``: ``mp.state_dict()`` (recipe, scaler, steps, masters, layout) and what this
  checkpoint is (``meta``); ``scheduler``: an lr scheduler's state, if given.

Loading onto the same world size resumes bit for bit. Onto another world size: FSDP2 shards are
resharded by DCP and replicated state is replicated, so it works; a checkpoint whose optimizer
state cannot be mapped onto this layout (blob <-> names: a 16-bit storage recipe saved under DDP
and loaded under FSDP2, or back) is refused before anything is loaded, saying so.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model/optimizer/MixedPrecision; the message says why."""


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _dcp(fn: Any, state: dict[str, Any], path: str) -> Any:
    """``dcp.save`` / ``dcp.load``; on one process without a process group, and without DCP's warning
    that it assumes one process (it is what was meant)."""
    no_dist = _no_dist()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(state, checkpoint_id=str(path), no_dist=no_dist)


def _opts(optimizer: Any) -> list[torch.optim.Optimizer]:
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(o).__name__}")
    return opts


def _blob(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _layout(mp: Any) -> dict[str, Any]:
    dist_state = mp._dist.state() if mp._dist is not None else {"mode": "none", "world_size": 1}
    return {
        "version": VERSION,
        "recipe": mp.recipe.name,
        "mode": dist_state["mode"],
        "world_size": dist_state["world_size"],
        # optimizer over fp32 masters the model does not hold: one replicated blob
        "optimizer": "blob" if mp.masters is not None else "names",
    }


def _state(model: nn.Module, opts: Sequence[torch.optim.Optimizer], mp: Any, scheduler: Any) -> dict[str, Any]:
    """The state dict DCP writes (and, built on the loading side, the one it reads into)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    layout = _layout(mp)
    if layout["optimizer"] == "blob":
        optim: Any = {"blob": _blob([o.state_dict() for o in opts])}
    else:
        optim = get_optimizer_state_dict(model, list(opts)) if opts else {}
    state = {
        "model": get_model_state_dict(model),
        "optimizer": optim,
        # (the layout is in meta: "parallel" may differ between the saving and the loading run)
        "mixprec": {"meta": layout, "state": {k: v for k, v in mp.state_dict().items() if k != "parallel"}},
    }
    if scheduler is not None:
        state["scheduler"] = _blob(scheduler.state_dict())
    return state


def save_checkpoint(path: str, *, model: nn.Module, optimizer: Any, mp: Any, scheduler: Any = None) -> None:
    """Write a checkpoint of ``model`` (as ``mp.prepare`` returned it), ``optimizer`` (one or a list),
    ``mp`` and, optionally, an lr ``scheduler`` into the directory ``path`` (on a file system every
    rank sees). Call on every rank, between steps (not inside an accumulation window)."""
    import torch.distributed.checkpoint as dcp

    _dcp(dcp.save, _state(model, _opts(optimizer), mp, scheduler), path)


def _read_meta(path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not Path(path).is_dir():
        raise CheckpointError(f"no checkpoint at {path}: save_checkpoint writes a directory (on a file system "
                              "every rank sees)")
    meta = {"version": 0, "recipe": "", "mode": "", "world_size": 0, "optimizer": ""}
    try:
        _dcp(dcp.load, {"mixprec": {"meta": meta}}, path)
    except (Exception, CheckpointException) as e:  # not a directory DCP wrote, or not one of ours
        raise CheckpointError(f"{path}: not a mixprec checkpoint (written by mixprec.save_checkpoint): "
                              f"{type(e).__name__}: {str(e)[:300]}") from e
    return meta


def load_checkpoint(path: str, *, model: nn.Module, optimizer: Any, mp: Any, scheduler: Any = None) -> None:
    """Load what ``save_checkpoint`` wrote into ``model``, ``optimizer``, ``mp`` (and ``scheduler``),
    prepared as for training (``mp.prepare(model, parallel=...)``, the optimizer over
    ``mp.parameters(model)``). Call on every rank. Raises ``CheckpointError`` (on every rank alike:
    they read the same files) when the checkpoint cannot go into this layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    opts = _opts(optimizer)
    meta = _read_meta(path)
    here = _layout(mp)
    if meta["version"] != VERSION:
        raise CheckpointError(f"{path}: written by another version of mixprec's checkpoint format "
                              f"({meta['version']}, this one reads {VERSION})")
    if meta["recipe"] != here["recipe"]:
        raise CheckpointError(f"{path} was saved with recipe {meta['recipe']!r}; this MixedPrecision uses "
                              f"{here['recipe']!r}. Resume with the recipe it was saved with")
    if meta["optimizer"] != here["optimizer"]:
        raise CheckpointError(
            f"{path} was saved under parallel={meta['mode']!r} with recipe {meta['recipe']!r}, whose optimizer state "
            f"is {'one replicated blob over fp32 masters' if meta['optimizer'] == 'blob' else 'keyed by parameter'}; "
            f"under parallel={here['mode']!r} it is "
            f"{'one replicated blob' if here['optimizer'] == 'blob' else 'keyed by parameter (the sharded masters)'}. "
            f"Resume with parallel={meta['mode'] if meta['mode'] != 'none' else None!r}"
        )
    state = _state(model, opts, mp, scheduler)
    if scheduler is not None and "scheduler" not in _keys(path):
        raise CheckpointError(f"{path} holds no lr scheduler state; load without scheduler=")
    _dcp(dcp.load, state, path)
    set_model_state_dict(model, state["model"])
    if here["optimizer"] == "blob":
        saved = _unblob(state["optimizer"]["blob"])
        if len(saved) != len(opts):
            raise CheckpointError(f"{path} holds {len(saved)} optimizer(s); {len(opts)} given")
        for o, sd in zip(opts, saved):
            o.load_state_dict(sd)
    elif opts:
        set_optimizer_state_dict(model, opts, state["optimizer"])
    mp.load_state_dict(state["mixprec"]["state"])  # after the model: the masters (if any) win
    if scheduler is not None:
        scheduler.load_state_dict(_unblob(state["scheduler"]))


def _keys(path: str) -> set[str]:
    """Top-level keys of a DCP checkpoint (from its metadata file)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
