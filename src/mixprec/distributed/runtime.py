"""``Parallel``: what ``MixedPrecision`` asks of torch.distributed while it trains.

``prepare(model, parallel=...)`` leaves one on the ``MixedPrecision`` (``mp._dist``); the step calls it
at four points and nowhere else (on one process ``mp._dist`` is None and the step never comes here):

- ``backward``: the backward of a micro-step that is not an accumulation boundary runs without
  gradient communication (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``); the
  boundary's backward reduces.
- ``reduce_master_grads``: for a 16-bit storage recipe under DDP, the fp32 master gradients,
  averaged over the ranks in fp32 at the boundary (DDP's own reduction of the 16-bit gradients is
  switched off with a comm hook that communicates nothing).
- ``all_reduce_max``: the loss scaler's inf/NaN flag, made the same on every rank (MAX) before any
  rank steps: one skip decision, one scale update.
- ``clip_grad_norm_``: the norm over every rank's gradients (FSDP2's are shards: DTensors), so
  every rank clips by the same coefficient.

Each is a collective: every rank calls it at the same point of the same step (the step's order is
fixed, so they do).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.formats import get_format

#: elements per all-reduce of the fp32 master gradients (a flat copy of this many is the extra memory)
CHUNK_NUMEL = 1 << 24


class Parallel:
    """The distributed side of one ``MixedPrecision`` (see the module docstring)."""

    def __init__(self, config: Any, model: nn.Module, local: nn.Module, group: Any, mesh: Any = None,
                 groups: list[tuple[str, str]] | None = None) -> None:
        self.config = config
        self.mode: str = config.mode
        self.group = group  # None: the default group
        self.mesh = mesh
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.fsdp_groups = groups or []  # (unit, "fp32" | "compute"), FSDP only
        self._model = weakref.ref(model)  # what prepare returned (the DDP wrapper, or the sharded module)
        self._local = weakref.ref(local)  # the module the recipe was applied to

    # ------------------------------------------------------------------ the model

    def local_module(self, model: nn.Module) -> nn.Module:
        """The module inside a DDP wrapper (the module itself otherwise)."""
        wrapped = self._model()
        if model is wrapped and self.mode == "ddp":
            return wrapped.module  # type: ignore[union-attr]
        return model

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, *, boundary: bool, accumulating: bool, retain_graph: bool = False) -> None:
        """``loss.backward()``; gradients are communicated only at an accumulation boundary."""
        model = self._model()
        if not accumulating or model is None:
            loss.backward(retain_graph=retain_graph)
            return
        if self.mode == "ddp":
            with contextlib.nullcontext() if boundary else model.no_sync():
                loss.backward(retain_graph=retain_graph)
            return
        model.set_requires_gradient_sync(boundary)  # type: ignore[operator]
        loss.backward(retain_graph=retain_graph)

    def reduce_master_grads(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Average the fp32 gradients of ``named`` (what the optimizer holds: masters and fp32
        parameters) over the ranks, in fp32. A gradient missing on a rank (a parameter it did not
        use) counts as zero there; one missing on every rank stays None, as on one process."""
        params = [p for _, p in named if p.requires_grad]
        if not params:
            return
        if getattr(self.config, "find_unused_parameters", False):
            # which parameters some rank used: a small mask, read on the host (a sync DDP's own
            # unused-parameter search makes too)
            present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=params[0].device)
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
            used = [bool(v) for v in present.tolist()]
        else:  # DDP refuses a backward that leaves a parameter without a gradient: every rank has them all
            used = [True] * len(params)
        grads = []
        for p, anywhere in zip(params, used):
            if anywhere and p.grad is None:
                p.grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if anywhere:
                grads.append(p.grad)
        start = 0
        while start < len(grads):
            chunk, numel = [], 0
            while start < len(grads) and (not chunk or numel + grads[start].numel() <= CHUNK_NUMEL):
                chunk.append(grads[start])
                numel += grads[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in chunk])
            # divide first, as DDP does: (g0 / n) + (g1 / n) + ... in fp32
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
            views = [v.view_as(g) for v, g in zip(torch.split(flat, [g.numel() for g in chunk]), chunk)]
            torch._foreach_copy_(chunk, views)

    def all_reduce_max(self, found: torch.Tensor) -> None:
        """The loss scaler's found-inf flag, in place: the largest over the ranks."""
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None, norm_type: float) -> torch.Tensor:
        """The total norm of every rank's gradients of ``params`` (a plain 0-d tensor, the same on
        every rank), and, with ``max_norm``, the gradients scaled by ``max_norm / (norm + 1e-6)``
        when that is below 1 (``torch.nn.utils.clip_grad_norm_``'s rule)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=params[0].device if params else "cpu")
        # sharded (DTensor) gradients and plain ones apart: torch combines one kind at a time
        kinds: dict[bool, list[torch.Tensor]] = {}
        for g in grads:
            kinds.setdefault(hasattr(g, "full_tensor"), []).append(g)
        norms = []
        for sharded, gs in kinds.items():
            norm = nn.utils.get_total_norm(gs, norm_type=norm_type)
            # a DTensor: the shards' norms combined over the ranks (a sum of powers, or a max for inf)
            norms.append(norm.full_tensor() if sharded else norm)
        first = norms[0].device
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
            torch.stack([n.to(first) for n in norms]), norm_type)
        if max_norm is not None:
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in local:
                by_device.setdefault(g.device, []).append(g)
            with torch.no_grad():
                for dev, gs in by_device.items():
                    torch._foreach_mul_(gs, coef.to(dev))
        return total

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of the layout (``mp.state_dict()["parallel"]``)."""
        return {"mode": self.mode, "world_size": self.world_size, "wire": get_format(self.config.wire_dtype).name}

    def describe(self) -> str:
        return f"{self.config.describe()}, {self.world_size} ranks"
