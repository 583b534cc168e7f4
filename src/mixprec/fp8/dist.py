"""fp8 across data-parallel ranks: delayed scaling's amaxes reduced over the group, as Transformer Engine does.

Each rank of a data-parallel job casts its own slice of the batch, so each records its own amaxes.
Left alone, the ranks' histories and scales drift apart (under DDP, which broadcasts module buffers
from rank 0 before every forward, every rank would scale with rank 0's history alone). TE's
``DelayedScaling(reduce_amax=True)`` (its default) all-reduces the current amaxes with MAX over the
data-parallel group before the update; so does mixprec (``Fp8Spec.reduce_amax``, default True): one
all-reduce of a ``(layers, 3)`` tensor per optimizer step, after the last micro-batch. Every rank
then holds the same history and scales, and they are the ones one process computes on the whole
global batch (the max of the ranks' maxima is the batch's maximum): bitwise (tests/fp8).

The group: the one ``prepare(model, parallel=...)`` trains over (DDP's process group, FSDP2's
one-dimensional mesh; the whole job for a two-dimensional, hybrid mesh); without ``parallel=``,
the default group when torch.distributed is initialised with more than one rank (as TE, whose
``fp8_group`` defaults to the world). With ``reduce_amax=False`` each rank keeps its own history.

The scaling buffers are kept out of DDP's buffer broadcast (``buffer_names``): a broadcast before each
micro-batch's forward would overwrite the amaxes the other ranks recorded in the earlier ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BUFFERS = ("fp8_amax_history", "fp8_scale")


def buffer_names(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s fp8 scaling buffers (what DDP must not broadcast)."""
    return [n for n, _ in model.named_buffers() if n.rpartition(".")[2] in BUFFERS]


def amax_group(parallel: Any) -> tuple[bool, Any]:
    """``(reduce?, group)``: whether there are ranks to reduce over, and the group (None: the default)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    group = None
    if parallel is not None:
        group = parallel.group
        mesh = getattr(parallel, "mesh", None)
        if group is None and mesh is not None and mesh.ndim == 1:
            group = mesh.get_group()
    return dist.get_world_size(group) > 1, group


def reduce_amax_(histories: list[torch.Tensor], group: Any) -> None:
    """All-reduce (MAX) the current slot (row 0) of every history over ``group``, in one collective."""
    current = torch.stack([h[0] for h in histories])
    dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_([h[0] for h in histories], list(current.unbind(0)))
