"""What ``prepare(model, parallel=...)`` accepts: ``"ddp"``, ``"fsdp"``, or a ``DDP`` / ``FSDP`` value.

Both are frozen dataclasses (derive variants with ``dataclasses.replace``); ``as_parallel`` turns
what a user passed into one of them, or says what it accepts.

>>> as_parallel("fsdp")
FSDP(reduce_dtype=torch.float32, mesh=None, units=None, reshard_after_forward=True, fp8_all_gather=False)
>>> as_parallel(DDP(compress="bf16")).wire_dtype
torch.bfloat16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.formats import get_format

_WIRE = ("fp32", "bf16", "fp16")


def _wire_dtype(value: Any, what: str) -> torch.dtype:
    try:
        dtype = get_format(value).dtype
    except (ValueError, TypeError):
        dtype = None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what}={value!r}: gradients go on the wire in one of {', '.join(_WIRE)} "
                         "(fp32 is the default and the safe choice; see docs/distributed.md)")
    return dtype


def _flag(config: Any, kind: str, name: str) -> None:
    """A switch is a bool: "no" or 1 would otherwise be read as truthy (on)."""
    value = getattr(config, name)
    if not isinstance(value, bool):
        raise TypeError(f"{kind}({name}=...) is True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DDP:
    """Data parallel with ``torch.nn.parallel.DistributedDataParallel``: every rank holds the whole
    model, gradients are averaged across ranks.

    Attributes:
        compress: None (default): gradients are all-reduced in fp32, whatever the recipe computes
            in. ``"bf16"`` / ``"fp16"``: a comm hook casts each bucket to that dtype for the
            all-reduce (half the bytes on the wire; see docs/distributed.md for when it is safe).
            Not with 16-bit storage recipes, whose gradients are reduced as fp32 master gradients.
        bucket_cap_mb, find_unused_parameters, broadcast_buffers, gradient_as_bucket_view: passed
            to ``DistributedDataParallel`` (None: torch's default).
        process_group: the group to reduce over (None: the default group).
    """

    compress: str | None = None
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = True
    process_group: Any = None

    mode = "ddp"

    def __post_init__(self) -> None:
        if self.compress is not None:
            _wire_dtype(self.compress, "DDP(compress)")
        for name in ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view"):
            _flag(self, "DDP", name)
        b = self.bucket_cap_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf")):
            raise ValueError(f"DDP(bucket_cap_mb=...) is a positive number of megabytes or None, got {b!r}")

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype gradients cross the network in."""
        return torch.float32 if self.compress is None else _wire_dtype(self.compress, "DDP(compress)")

    def describe(self) -> str:
        return f"ddp, gradients all-reduced in {get_format(self.wire_dtype).name}"


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters,
    gradients and optimizer state are sharded over the ranks; each unit's parameters are
    all-gathered in the compute dtype for its forward and backward.

    Attributes:
        reduce_dtype: the dtype gradients are reduce-scattered in: fp32 (default) or bf16/fp16.
        mesh: a ``DeviceMesh``; 1-D shards over all its ranks, 2-D is HSDP (replicate over the
            first dimension, shard over the second). None: a 1-D mesh over the default group.
        units: the modules that are all-gathered together (names, classes or class names, as
            ``fp32_modules``). None: every module held in an ``nn.ModuleList`` (the blocks of a
            transformer), then the root.
        reshard_after_forward: free each unit's gathered parameters after its forward (and
            gather them again for backward): less memory, more communication.
        fp8_all_gather: an fp8 recipe's fp8 layers all-gather their weights as fp8 bits, 1 byte per
            element instead of 4 (torchao's ``enable_fsdp_float8_all_gather``; ``mixprec.fp8.fsdp``).
    """

    reduce_dtype: Any = torch.float32
    mesh: Any = None
    units: Sequence[Any] | None = None
    reshard_after_forward: bool = True
    fp8_all_gather: bool = False

    mode = "fsdp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "reduce_dtype", _wire_dtype(self.reduce_dtype, "FSDP(reduce_dtype)"))
        if self.units is not None and (isinstance(self.units, (str, type)) or not isinstance(self.units, Sequence)):
            raise TypeError(f"FSDP(units=...) is a list of module names, classes or class names, got {self.units!r}")
        _flag(self, "FSDP", "reshard_after_forward")
        _flag(self, "FSDP", "fp8_all_gather")
        if self.mesh is not None and not (hasattr(self.mesh, "mesh_dim_names") and hasattr(self.mesh, "ndim")):
            raise TypeError("FSDP(mesh=...) is a torch.distributed.device_mesh.DeviceMesh (init_device_mesh) or None, "
                            f"got {type(self.mesh).__name__}")

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.reduce_dtype

    def describe(self) -> str:
        mesh = "" if self.mesh is None else f", mesh {tuple(self.mesh.shape)}"
        return f"fsdp, gradients reduce-scattered in {get_format(self.reduce_dtype).name}{mesh}"


Parallel = DDP | FSDP


def as_parallel(spec: Any) -> Parallel:
    """``"ddp"``, ``"fsdp"`` (case-insensitive), a ``DDP`` or an ``FSDP`` -> the config value."""
    if isinstance(spec, (DDP, FSDP)):
        return spec
    if isinstance(spec, str) and spec.strip().lower() in ("ddp", "fsdp"):
        return DDP() if spec.strip().lower() == "ddp" else FSDP()
    raise ValueError(
        f"parallel={spec!r}: expected 'ddp', 'fsdp', mixprec.distributed.DDP(...) or mixprec.distributed.FSDP(...) "
        "(or None for one process)"
    )
