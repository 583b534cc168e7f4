"""What ``load_checkpoint`` checks before it changes anything: that the checkpoint fits this run
(recipe, optimizer layout, scheduler), that every tensor this model, optimizer and MixedPrecision
need is in it with the same shape and dtype, and that what was read can be assigned. Each check
raises ``CheckpointError`` naming what differs and what to do; none touches a live object."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.distributed import checkpoint_layout as layout
from mixprec.distributed.checkpoint_layout import CheckpointError

_SHOWN = 6  # problems listed in one message


def _listing(problems: list[str]) -> str:
    more = len(problems) - _SHOWN
    return "; ".join(problems[:_SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def damaged(directory: Path, problems: list[str]) -> str:
    """The message for a checkpoint whose files do not match its manifest."""
    root = directory.parent
    others = [n for n in layout.complete_checkpoints(root) if n != directory.name] if root.is_dir() else []
    then = (f"load an earlier checkpoint by its path ({', '.join(str(root / n) for n in others[-3:])})" if others
            else "there is no other complete checkpoint beside it")
    return f"{directory} is damaged: {_listing(problems)}. It cannot be loaded; {then}"


def check_layout(directory: Path, marker: dict[str, Any], here: dict[str, Any], scheduler: Any) -> None:
    """The recipe, the optimizer's layout and the scheduler, from the marker alone."""
    if marker.get("recipe") != here["recipe"]:
        raise CheckpointError(f"{directory} was saved with recipe {marker.get('recipe')!r}; this MixedPrecision uses "
                              f"{here['recipe']!r}. Resume with the recipe it was saved with")
    if marker.get("optimizer") != here["optimizer"]:
        mode, blob = marker.get("mode"), marker.get("optimizer") == "blob"
        raise CheckpointError(
            f"{directory} was saved under parallel={mode!r} with recipe {marker.get('recipe')!r}, whose optimizer "
            f"state is {'one replicated blob over fp32 masters' if blob else 'keyed by parameter'}; "
            f"under parallel={here['mode']!r} it is "
            f"{'one replicated blob' if here['optimizer'] == 'blob' else 'keyed by parameter (the sharded masters)'}. "
            f"Resume with parallel={mode if mode != 'none' else None!r}"
        )
    if scheduler is not None and not marker.get("scheduler"):
        raise CheckpointError(f"{directory} holds no lr scheduler state; load without scheduler=")


def _dims(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "a scalar"


def _what(key: str, params: set[str]) -> tuple[str, str]:
    """(what kind of entry, of which tensor) for a flattened DCP key."""
    section, _, rest = key.partition(".")
    if section == "model":
        return ("parameter" if rest in params else "tensor", rest)
    for prefix, kind in (("state.", "optimizer state"), ("param_groups.", "optimizer setting")):
        if section == "optimizer" and rest.startswith(prefix):
            name, _, slot = rest[len(prefix):].rpartition(".")
            return (f"{kind} {slot!r} of", f"parameter group {name}" if name.isdigit() else name)
    return (f"{section} state", rest)


def _grouped(problems: list[tuple[str, str, str]]) -> list[str]:
    """(kind, name, issue) -> lines, in order; the same kind and issue for many tensors other than
    parameters (optimizer state, settings) said once."""
    groups: dict[tuple[str, str], list[str]] = {}
    for kind, name, issue in problems:
        groups.setdefault((kind, issue) if kind != "parameter" else (kind, f"{name}: {issue}"), []).append(name)
    lines = []
    for (kind, issue), names in groups.items():
        if kind == "parameter":
            lines.append(f"{kind} {issue}")
        elif len(names) > 2:
            lines.append(f"{kind} {names[0]}, {names[1]} and {len(names) - 2} more: {issue}")
        else:
            lines += [f"{kind} {n}: {issue}" for n in names]
    return lines


def check_tensors(directory: Path, template: dict[str, Any], model: nn.Module) -> None:
    """Every entry of ``template`` (what this run would save) is in the checkpoint, each tensor
    with the same shape and dtype, and the checkpoint holds no model tensor this model lacks."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(template)  # (the keys DCP itself reads)
    params = set(template["model"]) & {n.removeprefix("module.") for n, _ in model.named_parameters()}
    in_model: list[tuple[str, str, str]] = []  # the model's problems first: the optimizer's repeat them
    elsewhere: list[tuple[str, str, str]] = []
    for key, value in flat.items():
        kind, name = _what(key, params)
        into, meta = in_model if key.startswith("model.") else elsewhere, saved.get(key)
        if meta is None:
            into.append((kind, name, "not in the checkpoint"))
        elif isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                into.append((kind, name, "the checkpoint holds an object there, not a tensor"))
            elif tuple(meta.size) != tuple(value.shape):
                into.append((kind, name, f"checkpoint {_dims(meta.size)}, model {_dims(value.shape)}"))
            elif meta.properties.dtype != value.dtype:
                into.append((kind, name, f"checkpoint {str(meta.properties.dtype).removeprefix('torch.')}, "
                                         f"model {str(value.dtype).removeprefix('torch.')}"))
    in_model += [("tensor", k[len("model."):], "in the checkpoint, not in this model") for k in sorted(saved)
                 if k.startswith("model.") and k not in flat]
    # mixprec's own state this run would not take (another set of fp8 layers: their amax histories were dropped)
    elsewhere += [(*_what(k, params), "in the checkpoint, not in this run") for k in sorted(saved)
                  if k.startswith("mixprec.") and k not in flat]
    if in_model:
        raise CheckpointError(f"{directory} does not fit this model: {_listing(_grouped(in_model))}. Load it into the "
                              "model it was saved from (the same architecture and configuration)")
    if elsewhere:
        raise CheckpointError(f"{directory} does not fit this optimizer or MixedPrecision: "
                              f"{_listing(_grouped(elsewhere))}. Load it with the kind of optimizer (and settings) "
                              "and the MixedPrecision options it was saved with")


def _strings(state: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _strings(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): state} if isinstance(state, str) else {}


def check_staged(directory: Path, staged: dict[str, Any], template: dict[str, Any],
                 opts: Sequence[torch.optim.Optimizer], saved_opts: list[Any] | None) -> None:
    """What was read must be assignable as a whole (a failed assignment would be a half-load):
    mixprec's named settings (master strategy, storage format...) as in this run; as many
    optimizers, with the same parameter groups, as given."""
    here, got = _strings(template["mixprec"]["state"]), _strings(staged["mixprec"]["state"])
    for key in sorted(here):
        if got.get(key) != here[key]:
            raise CheckpointError(f"{directory}: mixprec state {key} is {got.get(key)!r} in the checkpoint and "
                                  f"{here[key]!r} in this run. Resume with the recipe and options it was saved with")
    if saved_opts is None:
        return
    if len(saved_opts) != len(opts):
        raise CheckpointError(f"{directory} holds {len(saved_opts)} optimizer(s); {len(opts)} given")
    for i, (o, sd) in enumerate(zip(opts, saved_opts)):
        want, have = [len(g["params"]) for g in o.param_groups], [len(g["params"]) for g in sd["param_groups"]]
        if want != have:
            raise CheckpointError(f"{directory}: optimizer {i} was saved with parameter groups of {have} tensors; this "
                                  f"one has {want}. Build the optimizer as the saving run did")
