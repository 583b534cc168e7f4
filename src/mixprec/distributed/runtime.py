"""``Parallel``: the strategy ``MixedPrecision`` calls while it trains (``mixprec.seam.Strategy``).

``prepare(model, parallel=...)`` leaves one on the ``MixedPrecision`` (``mp._dist``); the facade calls
it at the points ``mixprec.seam.Strategy`` lists and nowhere else (on one process ``mp._dist`` is None
and the step never comes here):

- ``backward``: gradients are communicated at the accumulation boundary only. DDP decides at
  forward time, so a forward pre-hook on the wrapper runs the forward of every micro-step before
  the boundary without synchronisation (what ``no_sync()`` does): one all-reduce per window.
  FSDP2 decides at backward time (``set_requires_gradient_sync``).
- ``reduce_master_grads``: for a 16-bit storage recipe under DDP, the fp32 master gradients,
  averaged over the ranks in fp32 at the boundary (DDP's own reduction of the 16-bit gradients is
  switched off with a comm hook that communicates nothing).
- ``share_skip_decision``: the loss scaler's inf/NaN flag, made the same on every rank (MAX) before
  any rank steps: one skip decision, one scale update. The same all-reduce checks that the ranks
  are in step (``alignment``).
- ``clip_grad_norm_``: the norm over every rank's gradients (FSDP2's are shards: DTensors), so
  every rank clips by the same coefficient.
- ``discard`` / ``stepped`` / ``loaded``: a window discarded (``mp.reset``), a step finished, a
  checkpoint loaded: what ``alignment`` needs to know.

Each collective is called by every rank at the same point of the same step (the step's order is
fixed, so they are; ``alignment`` says what happens when a rank's step raised).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.alignment import WINDOW, Alignment, DesyncError
from mixprec.formats import get_format

#: elements per all-reduce of the fp32 master gradients (a flat copy of this many is the extra memory)
CHUNK_NUMEL = 1 << 24


class Parallel:
    """The distributed side of one ``MixedPrecision`` (see the module docstring)."""

    def __init__(self, config: Any, model: nn.Module, local: nn.Module, group: Any, mesh: Any = None,
                 groups: list[tuple[str, str]] | None = None, *, accumulate: int = 1,
                 device: torch.device | None = None, masters: bool = False) -> None:
        self.config = config
        self.mode: str = config.mode
        self.group = group  # None: the default group
        self.mesh = mesh
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.fsdp_groups = groups or []  # (unit, "fp32" | "compute"), FSDP only
        self.accumulate = accumulate
        self.device = device if device is not None else torch.device("cpu")
        self._model = weakref.ref(model)  # what prepare returned (the DDP wrapper, or the sharded module)
        self._local = weakref.ref(local)  # the module the recipe was applied to
        self._micro = 0  # micro-steps completed in the current window
        self._synced = False  # the last forward prepared DDP to synchronise in backward
        self._saved_sync: bool | None = None
        self._masters = masters  # DDP: the step averages fp32 master gradients (reduce_master_grads)
        self._master_params: list[torch.Tensor] | None = None  # (their shapes, for a step this rank shadows)
        used = [group if group is not None else dist.group.WORLD]
        if mesh is not None:
            used += [g for g in mesh.get_all_groups() if all(g is not u for u in used)]
        self.alignment = Alignment(group, [dist.distributed_c10d._get_default_group() if g is dist.group.WORLD else g
                                           for g in used], self.rank, self.mode)
        self._fresh = False  # the forward in progress starts a micro-step
        # first of the model's forward pre-hooks (FSDP2's all-gather and DDP's own forward come after)
        model.register_forward_pre_hook(self._before_forward, prepend=True)
        model.register_forward_hook(self._after_forward)
        if self.mode == "ddp":
            model.register_forward_hook(self._restore_sync, always_call=True)
            # the rest point is inside DDP's forward, after its own collectives (a bucket rebuild at the
            # second iteration, the buffer broadcast): every rank that gets there has made them
            local.register_forward_pre_hook(self._rest_if_fresh, prepend=True)

    # ------------------------------------------------------------------ the forward

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        align = self.alignment
        align.require_usable()  # a broken rank starts no collective (FSDP2 all-gathers, DDP broadcasts)
        self._fresh = not align.open  # (a second forward of the same micro-step is inside it)
        if self.mode == "fsdp":
            self._rest_if_fresh(module, args)
        if not torch.is_grad_enabled():
            return
        align.open, align.decided = True, False
        if self.mode == "ddp":  # DDP reads this in its forward: the backward of this micro-step syncs or not
            self._saved_sync = module.require_backward_grad_sync
            sync = self._saved_sync and self._micro + 1 >= self.accumulate
            module.require_backward_grad_sync = sync
            self._synced = sync

    def _rest_if_fresh(self, module: nn.Module, args: Any) -> None:
        if self._fresh:
            self.alignment.rest()
            self._fresh = False

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows: every rank finished this forward's collectives
            self.alignment.rest()

    def _restore_sync(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._saved_sync is not None:  # (a user's own no_sync() context sees its value again)
            module.require_backward_grad_sync = self._saved_sync
            self._saved_sync = None

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
        align = self.alignment
        align.require_usable()
        align.open = True
        model = self._model()
        if self.mode == "fsdp" and accumulating and model is not None:
            model.set_requires_gradient_sync(boundary)  # type: ignore[operator]
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException:
            # DDP's reducer waits for the rest of a synchronising backward that raised
            align.interrupted = self.mode == "ddp" and self._synced
            raise
        self._micro += 1  # (at the boundary: accumulate, until the decision)
        if not boundary:  # this micro-step's collectives are done (the boundary's go on to the decision)
            align.open = False
            align.rest()

    def reduce_master_grads(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Average the fp32 gradients of ``named`` (what the optimizer holds: masters and fp32
        parameters) over the ranks, in fp32. A gradient missing on a rank (a parameter it did not
        use) counts as zero there; one missing on every rank stays None, as on one process."""
        self.alignment.require_usable()
        params = [p for _, p in named if p.requires_grad]
        self._master_params = params
        self._reduce_master_grads(params)

    def _reduce_master_grads(self, params: list[torch.Tensor], shadow: bool = False) -> None:
        """(``shadow``: this rank contributes zeros and keeps nothing: its step was discarded.)"""
        if not params:
            return
        if getattr(self.config, "find_unused_parameters", False):
            # which parameters some rank used: a small mask, read on the host (a sync DDP's own
            # unused-parameter search makes too)
            present = torch.tensor([p.grad is not None and not shadow for p in params], dtype=torch.uint8,
                                   device=params[0].device)
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
            used = [bool(v) for v in present.tolist()]
        else:  # DDP refuses a backward that leaves a parameter without a gradient: every rank has them all
            used = [True] * len(params)
        grads = []
        for p, anywhere in zip(params, used):
            if shadow and anywhere:
                grads.append(torch.zeros(p.shape, dtype=torch.float32, device=p.device))
                continue
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

    def share_skip_decision(self, scaler: Any, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
        """The loss scaler's found-inf flag made the largest over the ranks, in place, by the all-reduce
        that also checks that the ranks are in step (``alignment``; raises ``DesyncError`` on every rank)."""
        self._micro = 0  # the window is over
        if scaler.is_enabled():
            scaler.share_skip_decision(optimizers, across=lambda found: self.alignment.exchange(found, steps, self.device))
        else:
            self.alignment.exchange(None, steps, self.device)

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None, norm_type: float) -> torch.Tensor:
        """The total norm of every rank's gradients of ``params`` (a plain 0-d tensor, the same on
        every rank), and, with ``max_norm``, the gradients scaled by ``max_norm / (norm + 1e-6)``
        when that is below 1 (``torch.nn.utils.clip_grad_norm_``'s rule)."""
        self.alignment.require_usable()
        total = self._clip(params, max_norm, norm_type)
        self.alignment.rest()
        return total

    def _clip(self, params: list[torch.Tensor], max_norm: float | None, norm_type: float) -> torch.Tensor:
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

    # ------------------------------------------------------------------ the window

    def discard(self, steps: int) -> int:
        """``mp.reset()``: this rank's window is gone (``alignment.Alignment.discard``). Returns the
        micro-step the facade's window goes on from: the place it has on the other ranks, so that
        every rank's boundary stays at the same call (0 when the window was over).

        Under DDP, a boundary micro-step that raised before any communication (in the forward, or
        between the forward and ``step``) is shadowed: this rank makes the collectives the others
        make in that step (zero gradients, as DDP's ``join`` does for a rank out of inputs, then the
        decision, which tells every rank), so that the ranks stay paired call for call."""
        align = self.alignment
        in_window = self._micro > 0 or align.open
        place = self._micro + (1 if align.open else 0)  # (a micro-step that raised still took its turn)
        boundary = align.open and not align.decided and place >= self.accumulate
        place = 0 if place >= self.accumulate or align.decided else place
        code = align.discard(partial=place > 0, in_window=in_window)
        self._micro = place
        if code == WINDOW and boundary and self.mode == "ddp":
            self._shadow(steps)
        return place

    def _shadow(self, steps: int) -> None:
        model = self._model()
        if model is None or (self._masters and self._master_params is None):
            self.alignment.break_("its first step raised before the ranks had made one together")
            return
        try:
            model._match_all_reduce_for_bwd_pass()  # type: ignore[operator]  (DDP's own, for join)
            if self.config.find_unused_parameters:
                model._match_unused_params_allreduce()  # type: ignore[operator]
            if self._masters:
                self._reduce_master_grads(self._master_params or [], shadow=True)
            try:
                self.alignment.exchange(None, steps, self.device)
            except DesyncError:
                pass  # (every rank learns of it there; this rank has raised its own exception)
            error = sys.exc_info()[1]
            if error is not None:
                error.add_note("mixprec: the other ranks discard this step too (they raise DesyncError), and every "
                               "rank stays in step")
        except Exception as e:  # noqa: BLE001 - a collective failed: this rank cannot go on
            self.alignment.break_(f"{type(e).__name__}: {e}")

    def stepped(self) -> None:
        """The optimizer step (or skip), the scheduler and what follows them finished on this rank."""
        self.alignment.stepped()

    def loaded(self) -> None:
        """``mp.load_state_dict`` ran: this rank holds the checkpoint's state (every rank loads the same)."""
        self._micro = 0
        self.alignment.loaded()

    # ------------------------------------------------------------------ state

    def require_consistent(self, what: str = "save a checkpoint") -> None:
        """Raise ``DesyncError`` when the replicas may differ (a ``DesyncError`` said so and no checkpoint
        was loaded since) or this rank is broken: for ``save_checkpoint``, which would write a mix of states."""
        self.alignment.require_usable()
        if self.alignment.diverged:
            raise DesyncError(f"cannot {what}: the replicas went apart ({self.alignment.diverged}) Load the last "
                              "checkpoint on every rank first.")

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of the layout (``mp.state_dict()["parallel"]``)."""
        self.alignment.require_usable()  # (a broken rank writes no checkpoint: its collectives would pair wrongly)
        return {"mode": self.mode, "world_size": self.world_size, "wire": get_format(self.config.wire_dtype).name}

    def describe(self) -> str:
        return f"{self.config.describe()}, {self.world_size} ranks"
