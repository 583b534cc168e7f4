"""``save_checkpoint`` / ``load_checkpoint``: the model, the optimizer(s) and everything mixprec holds
(the loss scaler, master weights, step counters), through ``torch.distributed.checkpoint`` (DCP).

Every rank calls them, at the same point (they are collectives); on one process they work alike
(DCP without a process group). ``path`` is a directory of checkpoints (``checkpoint_layout`` says
how it is laid out and how a save is published atomically). One checkpoint is one DCP directory:

- ``model``: ``get_model_state_dict`` (FSDP2: each rank writes its shards; DDP: rank 0 writes the
  replicated tensors once);
- ``optimizer``: ``get_optimizer_state_dict``, keyed by parameter names (sharded like the
  parameters under FSDP2), so DCP can reshard it for another world size. A 16-bit storage recipe
  outside FSDP2 builds its optimizer over fp32 masters the model does not hold; its optimizer
  state (replicated on every rank) is written as one serialized blob instead;
- ``mixprec``: ``mp.state_dict()`` (recipe, scaler, steps, masters, layout) and what this
  checkpoint is (``meta``); ``scheduler``: an lr scheduler's state, if given.

A save: rank 0 checks the path and creates a fresh temporary directory; every rank writes its
part (DCP); every rank records the size and CRC-32 of the files it wrote; rank 0 writes the
completion marker with that manifest, renames the directory into place and moves ``latest``.
Every rank returns when the checkpoint is published, or raises the same ``CheckpointError``.

A load validates before it touches anything: the marker, every file against the manifest (the
checksums split over the ranks), the recipe and layout, every tensor's name, shape and dtype
against this model and optimizer; then DCP reads into copies; then the copies are assigned. A
checkpoint that fails any check raises ``CheckpointError`` on every rank and leaves the model,
the optimizer, the scaler and the scheduler exactly as they were.

Loading onto the same world size resumes bit for bit. Onto another world size: FSDP2 shards are
resharded by DCP and replicated state is replicated, so it works; a checkpoint whose optimizer
state cannot be mapped onto this layout (blob <-> names: a 16-bit storage recipe saved under DDP
and loaded under FSDP2, or back) is refused before anything is loaded, saying so.
"""

from __future__ import annotations

import datetime
import io
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.distributed import checkpoint_checks as checks
from mixprec.distributed import checkpoint_layout as layout
from mixprec.distributed.checkpoint_agree import (_all_gather, _first_line, _no_dist, _peer_gone, _rank_world,
                                                  _require_same_replicas, agree_on_arguments)
from mixprec.distributed.checkpoint_layout import CheckpointError

VERSION = 1

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def _state_on_every_rank(root: Path, model: nn.Module, opts: Sequence[torch.optim.Optimizer], mp: Any,
                         scheduler: Any) -> dict[str, Any]:
    """``_state`` on every rank, agreed: if it raised on one rank (before any collective of the save), every
    rank raises the same ``CheckpointError`` naming it, at once, instead of that rank raising alone and the
    others waiting in the first collective until the timeout. A ``DesyncError`` (a rank whose collectives
    would pair wrongly) is raised as it is: such a rank starts no collective."""
    from mixprec.distributed.alignment import DesyncError

    state, problem, cause = None, None, None
    try:
        state = _state(model, opts, mp, scheduler)
    except DesyncError:
        raise
    except Exception as e:  # (inside an accumulation window, a state_dict that raised...)
        problem, cause = f"{type(e).__name__}: {_first_line(e)}", e
    try:
        found = [(r, p) for r, p in enumerate(_all_gather(problem)) if p]
    except RuntimeError as e:  # a peer died, or raised before the save (a DesyncError) and starts no collective
        rank, _ = _rank_world()
        raise CheckpointError(f"saving into {root}: {_peer_gone(rank, from_rank0=False)} ({_first_line(e)}). "
                              f"Nothing was written: {root}/latest still names the previous checkpoint") from cause
    if found:
        said = found[0][1] if len(found) == 1 and _no_dist() else "; ".join(f"rank {r}: {p}" for r, p in found)
        raise CheckpointError(f"saving into {root} failed before anything was written ({said}). Nothing was "
                              f"written: {root}/latest still names the previous checkpoint") from cause
    return state  # type: ignore[return-value]


def _agreed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on every rank; if it raised on any rank, every rank raises the same
    ``CheckpointError`` (a collective: no rank goes on while another stopped)."""
    value, problem, cause = None, None, None
    try:
        value = fn(*args)
    except CheckpointError as e:
        problem, cause = str(e), e
    except Exception as e:  # an OSError reading the files, or worse: said on every rank
        problem, cause = f"{type(e).__name__}: {e}", e
    found = [(r, p) for r, p in enumerate(_all_gather(problem)) if p]
    if len({p for _, p in found}) == 1:
        raise CheckpointError(found[0][1]) from cause
    if found:
        raise CheckpointError("; ".join(f"rank {r}: {p}" for r, p in found)) from cause
    return value


def _on_rank0(fn: Callable[[], Any], doing: str) -> Any:
    """``fn()`` on rank 0; every rank gets its value, or raises the same ``CheckpointError`` (a collective)."""
    import torch.distributed as dist

    rank, _ = _rank_world()
    result: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            result = [("ok", fn())]
        except CheckpointError as e:
            result, error = [("error", str(e))], e
        except Exception as e:  # an OSError (disk full, permissions), or worse: said on every rank
            result, error = [("error", f"{doing} failed on rank 0: {type(e).__name__}: {e}")], e
    if not _no_dist():
        try:
            dist.broadcast_object_list(result, src=0)
        except RuntimeError as e:  # a peer stopped (killed? raised before this collective?)
            raise CheckpointError(f"{doing}: {_peer_gone(rank)} ({_first_line(e)}). What is on disk is either the "
                                  "previous checkpoint or this one, whole: load_checkpoint loads the complete one "
                                  "that 'latest' names") from None
    kind, value = result[0]
    if kind == "error":
        if error is not None and not isinstance(error, (CheckpointError, OSError)):
            raise error
        raise CheckpointError(value) from error
    return value


def _dcp(fn: Any, state: dict[str, Any], path: Path, **kwargs: Any) -> Any:
    """``dcp.save`` / ``dcp.load``; on one process without a process group (and without DCP's
    warning that it assumes one process, which is what was meant). DCP's failures, reported on
    every rank as its ``CheckpointException``, become ``CheckpointError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    no_dist = _no_dist()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            return fn(state, checkpoint_id=str(path), no_dist=no_dist, **kwargs)
        except CheckpointException as e:  # a BaseException: turned into an Exception saying what went wrong
            raise CheckpointError(_failures(e)) from None


def _failures(e: Any) -> str:
    parts = [f"on rank {rank}: {type(exc).__name__}: {_first_line(exc)}"
             for rank, (exc, _trace) in sorted(getattr(e, "failures", {}).items())]
    return "; ".join(parts) or _first_line(e)


def _describe_failure(e: BaseException) -> str:
    """DCP's own failures name the rank ("on rank 1: ..."); an error outside them (DCP turns its
    ranks' exceptions into CheckpointException) came from a collective: a rank that stopped."""
    if isinstance(e, CheckpointError):
        return str(e)
    return f"in a collective, {type(e).__name__}: {_first_line(e)} (did another rank stop?)"


def _opts(optimizer: Any) -> list[torch.optim.Optimizer]:
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(o).__name__}")
    return opts


def _check_args(model: Any, mp: Any, scheduler: Any) -> None:
    """The objects of one training run, or a clear error before any file or tensor is touched: ``mp``
    the ``MixedPrecision`` that prepared ``model`` (a save with another one wrote its counters beside
    this model's weights; a load into an fp8 one not prepared yet dropped every amax history)."""
    if not all(hasattr(mp, a) for a in ("state_dict", "load_state_dict", "recipe", "_dist")):
        raise TypeError(f"mp must be the mixprec.MixedPrecision that prepared the model, got {type(mp).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module mp.prepare returned, got {type(model).__name__}")
    if scheduler is not None and not (callable(getattr(scheduler, "state_dict", None))
                                      and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(f"scheduler must be an lr scheduler (with state_dict/load_state_dict), got "
                        f"{type(scheduler).__name__}")
    ref = getattr(mp, "_model_ref", None)
    prepared = ref() if ref is not None else None
    if prepared is None:
        raise CheckpointError(f"this MixedPrecision has not prepared a model: call model = mp.prepare(model"
                              f"{', parallel=...' if not _no_dist() else ''}) first, then build the optimizer over "
                              "mp.parameters(model), as for training (a checkpoint holds the state prepare sets up: "
                              "fp8 scaling, master weights)")
    inner: Any = model
    for _ in range(4):  # DDP's .module, torch.compile's ._orig_mod
        if inner is prepared:
            return
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
    raise CheckpointError(f"model ({type(model).__name__}) is not the model this MixedPrecision prepared "
                          f"({type(prepared).__name__}): pass the model its mp.prepare returned, with that "
                          "MixedPrecision")


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

    meta = _layout(mp)
    if meta["optimizer"] == "blob":
        optim: Any = {"blob": _blob([o.state_dict() for o in opts])}
    else:
        optim = get_optimizer_state_dict(model, list(opts)) if opts else {}
    state = {
        "model": get_model_state_dict(model),
        "optimizer": optim,
        # (the layout is in meta: "parallel" may differ between the saving and the loading run)
        "mixprec": {"meta": meta, "state": {k: v for k, v in mp.state_dict().items() if k != "parallel"}},
    }
    if scheduler is not None:
        state["scheduler"] = _blob(scheduler.state_dict())
    return state


# ---------------------------------------------------------------------------- save


def save_checkpoint(path: str | Path, *, model: nn.Module, optimizer: Any, mp: Any, scheduler: Any = None,
                    keep: int | None = None) -> str:
    """Write a checkpoint of ``model`` (as ``mp.prepare`` returned it), ``optimizer`` (one or a list),
    ``mp`` and, optionally, an lr ``scheduler`` as ``path/step-N`` (N: ``mp``'s optimizer steps), and
    point ``path/latest`` at it once it is complete on every rank. ``path`` is a directory every
    rank sees. ``keep``: keep only the ``keep`` most recently saved checkpoints there (default:
    all). Call on every rank, between steps (not inside an accumulation window). Returns the
    checkpoint's directory. Raises ``CheckpointError`` (on every rank) when ``path`` cannot hold
    checkpoints or the save fails; the previous checkpoint stays what ``latest`` names."""
    import torch.distributed.checkpoint as dcp

    from mixprec.distributed import checkpoint_io

    def arguments() -> list[torch.optim.Optimizer]:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive integer (how many checkpoints to keep) or None (all), got "
                             f"{keep!r}")
        _check_args(model, mp, scheduler)
        return _opts(optimizer)

    consistent = getattr(getattr(mp, "_dist", None), "require_consistent", None)
    if consistent is not None:  # (a broken rank starts no collective; replicas that went apart would be saved as a mix)
        consistent()
    root, (rank, world) = Path(path), _rank_world()
    # (on every rank alike: one rank's bad argument would leave the others waiting in the first collective)
    opts = agree_on_arguments("saving into", path, arguments, "Nothing was written: 'latest' still names the previous "
                              "checkpoint")
    state = _state_on_every_rank(root, model, opts, mp, scheduler)  # (raises inside an accumulation window)
    if mp._dist is None and world > 1:  # (the same on every rank: a collective)
        _require_same_replicas(root, state)
    save_id = _on_rank0(lambda: layout.begin(root), f"preparing {root}")
    tmp = root / f"{layout.TMP}{save_id}"
    layout._fault_point("save:begin")
    files: dict[str, Any] = {}
    try:
        storage = checkpoint_io.writer(tmp)  # (sizes and CRC-32 computed as the files are written)
        _dcp(dcp.save, state, tmp, storage_writer=storage)
        layout._fault_point("save:written")
        mine, problem = None, None
        try:  # (an OSError reading a file back: said on every rank, or the others' next collectives pair wrongly)
            mine = checkpoint_io.digests(storage, tmp, layout.files_of_rank(tmp, rank))
        except Exception as e:  # noqa: BLE001
            problem = f"{type(e).__name__}: {_first_line(e)}"
        gathered = _all_gather((mine, problem))
        found = [(r, p) for r, (_, p) in enumerate(gathered) if p]
        if found:
            raise CheckpointError("; ".join(f"on rank {r}: {p}" for r, p in found))
        for part, _ in gathered:
            files.update(part)
    except (CheckpointError, RuntimeError) as e:  # (RuntimeError: a collective failed, another rank stopped?)
        raise CheckpointError(f"saving into {tmp} failed {_describe_failure(e)}. Nothing was published: "
                              f"{root}/latest still names the previous checkpoint, and the next save removes this "
                              "partial one") from None
    layout._fault_point("save:manifest")
    meta, step = state["mixprec"]["meta"], int(mp._steps)

    def finish() -> str:
        _check_every_file_seen(tmp, files)
        layout.write_marker(tmp, {
            "format": "mixprec-checkpoint", "layout": layout.LAYOUT, "step": step, "world_size": world,
            "mode": meta["mode"], "recipe": meta["recipe"], "optimizer": meta["optimizer"],
            "scheduler": scheduler is not None, "mixprec": _version(), "torch": torch.__version__,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "time": time.time(), "save_id": save_id, "checksum": "crc32", "files": files,
        })
        layout._fault_point("save:marker")
        name = layout.step_name(step)
        layout.publish(root, save_id, name)
        if keep is not None:
            layout.prune(root, keep, name)
        return name

    return str(root / _on_rank0(finish, f"publishing {tmp}"))


def _version() -> str:
    # the parent package is imported before any of its modules; its version is read, not imported
    # (the face is above this room)
    return str(getattr(sys.modules.get("mixprec"), "__version__", "unknown"))


def _check_every_file_seen(tmp: Path, files: dict[str, Any]) -> None:
    """Rank 0: every file DCP's metadata refers to is in the ranks' manifest and visible here."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(tmp)).read_metadata()
    used = {info.relative_path for info in (metadata.storage_data or {}).values()}
    unseen = sorted(n for n in used if n not in files or not (tmp / n).is_file())
    if unseen:
        raise CheckpointError(f"rank 0 does not see {', '.join(unseen[:4])} in {tmp}, which other ranks wrote: the "
                              "checkpoint path must be on a file system every rank sees (a shared or network one)")


# ---------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: Any, mp: Any, scheduler: Any = None,
                    checksums: bool = True) -> str:
    """Load a checkpoint ``save_checkpoint`` wrote into ``model``, ``optimizer``, ``mp`` (and
    ``scheduler``), prepared as for training (``mp.prepare(model, parallel=...)``, the optimizer over
    ``mp.parameters(model)``). ``path``: the path given to ``save_checkpoint`` (its ``latest``
    checkpoint is loaded) or one ``step-N`` directory in it. Call on every rank. Returns the
    directory loaded. Raises ``CheckpointError`` on every rank alike, with nothing changed, when
    the checkpoint is incomplete or damaged or does not fit this model, optimizer or layout.
    ``checksums=False`` checks the files' sizes against the manifest but not their CRC-32 (which
    reads every file once more, split over the ranks, before DCP reads it)."""
    import torch.distributed.checkpoint as dcp

    def arguments() -> list[torch.optim.Optimizer]:
        _check_args(model, mp, scheduler)
        if not isinstance(checksums, bool):  # ("no" is truthy: it checked every CRC)
            raise TypeError(f"checksums must be True (check each file's CRC-32) or False (sizes only), got "
                            f"{checksums!r}")
        return _opts(optimizer)

    opts = agree_on_arguments("loading", path, arguments, "Nothing was loaded")  # (on every rank alike)
    rank, world = _rank_world()

    def whole() -> Path:  # which checkpoint, and is it whole (every rank stats every file, checksums its share)
        directory = layout.resolve(Path(path))
        marker = layout.read_marker(directory)
        share = sorted(marker.get("files") or {})[rank::world] if checksums else []
        bad = layout.check_files(directory, marker, checksum=share)
        if bad:
            raise CheckpointError(checks.damaged(directory, bad))
        checks.check_layout(directory, marker, _layout(mp), scheduler)
        return directory

    directory = _agreed(whole)
    empty = [not o.state for o in opts]  # get_optimizer_state_dict initialises an empty optimizer's state
    try:
        template = _state(model, opts, mp, scheduler)
        _agreed(checks.check_tensors, directory, template, model)
        staged = _copy(template)
        try:
            _dcp(dcp.load, staged, directory)
        except (CheckpointError, RuntimeError) as e:
            raise CheckpointError(f"reading {directory} failed {_describe_failure(e)}; nothing was loaded") from None

        def readable() -> list[Any] | None:
            saved_opts = _unblob(staged["optimizer"]["blob"]) if "blob" in staged["optimizer"] else None
            checks.check_staged(directory, staged, template, opts, saved_opts)
            return saved_opts

        saved_opts = _agreed(readable)
    except BaseException:
        for o, was_empty in zip(opts, empty):
            if was_empty:  # as it was
                o.state.clear()
        raise
    _assign(model, opts, mp, scheduler, staged, saved_opts)
    return str(directory)


def _copy(state: Any) -> Any:
    """A copy of the state dict to read into: new containers, every tensor cloned (DTensors stay
    DTensors, sharded alike), so that a load that fails halfway leaves the live tensors alone."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state


def _assign(model: nn.Module, opts: Sequence[torch.optim.Optimizer], mp: Any, scheduler: Any,
            staged: dict[str, Any], saved_opts: list[Any] | None) -> None:
    """Write the validated copies into the live objects."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, staged["model"])
    if saved_opts is not None:
        for o, sd in zip(opts, saved_opts):
            o.load_state_dict(sd)
    elif opts:
        set_optimizer_state_dict(model, list(opts), staged["optimizer"])
    mp.load_state_dict(staged["mixprec"]["state"])  # after the model: the masters (if any) win
    if scheduler is not None:
        scheduler.load_state_dict(_unblob(staged["scheduler"]))
