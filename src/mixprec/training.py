"""``MixedPrecision``: the one object a user holds, and the only place that knows the order of a step.

    mp = MixedPrecision("auto", device="cpu")
    model = mp.prepare(model)
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    stats = mp.step(loss, opt, max_grad_norm=1.0)

``step`` runs: scale -> backward -> (accumulate) -> unscale -> clip -> step or skip -> update ->
zero_grad -> scheduler (only when the step was taken). The order is fixed here, so a user cannot
clip scaled gradients or forget ``update``.

Recipes that store parameters in 16 bits (``bf16-true``...) add two points to that order, both
owned by a ``mixprec.masters`` strategy: after backward, 16-bit gradients become fp32 master
gradients (so unscale and clip see fp32); after update, the stepped masters are written back into
the 16-bit model. Their optimizer is built over ``mp.parameters(model)``, the fp32 masters.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.attention import install as install_attention, with_attention
from mixprec.formats import short_name
from mixprec.islands import FAMILIES, Rule, as_rules, family_matches, keep_fp32
from mixprec.masters import MasterWeights, export, make_masters
from mixprec.masters.rules import island_param_rules
from mixprec.policy import PreparedForward, autocast_outside, cast_floating_buffers, prepared_forward_options
from mixprec.recipes import Recipe, as_device, as_requested, resolve_recipe
from mixprec.scaling import GradScaler
from mixprec.scaling.choose import scaler_for
from mixprec.seam import Local
from mixprec.step_io import (
    ModelsHeld,
    Optimizers,
    StepStats,
    _as_optimizers,
    check_loadable,
    check_loss,
    clip_dense_or_sparse,
    check_model_params,
    _check_max_grad_norm,
    _check_nan_guard,
    _check_schedulers,
    describe,
)



class MixedPrecision:
    """A recipe applied to a device: prepare the model, run the forward, take the step.

    Args:
        recipe: a name (``"auto"``, ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, aliases such as
            ``"16-mixed"``), a jmp policy string (``"p=f32,c=bf16,o=f32"``) or a ``Recipe``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a torch.device; None picks CUDA when available.
        scaler: None (the recipe's), a dict of ``GradScaler`` keyword arguments (``{"init_scale":
            2**20, "hysteresis": 2}``), or a mixprec scaler instance.
        fp32_modules: extra fp32 islands (qualified names, classes, class names, predicates).
        accumulate: optimizer step every ``accumulate`` calls to ``step``; the loss is divided by it.
        track_grad_norm: compute the gradient norm even when not clipping.
        skip_nonfinite: for recipes without a loss scaler, still skip steps whose gradients hold
            inf/NaN (a ``StaticLossScaler(1.0)``; one host sync per step with unfused optimizers).
        fp32_params: for recipes that store parameters in 16 bits, the rule for parameters kept in
            fp32, replacing the recipe's (``("norms", "biases", "embeddings", "bare")``); see
            ``mixprec.masters.rules``.
        nan_guard: attach ``mixprec.nan_guard`` to the model in ``prepare``: True (mode "raise"), a
            mode ("raise", "warn", "record") or a dict of its options. Off (False) adds no hooks.
        fp8: for fp8 recipes, ``Fp8Spec`` fields replacing the recipe's (``{"margin": 1}``), or an ``Fp8Spec``.
        attention: "fp32" or "fastest" (measured, cached) to run 16-bit autocast's attention product in
            fp32, "recipe" as the recipe does; None keeps the recipe's (``auto``: "fastest"; ``mixprec.attention``).

    Attributes: ``recipe`` (with ``recipe.reason``), ``device``, ``policy``, ``scaler``, ``masters``
    (the master-weight strategy of a 16-bit storage recipe, else None), ``guard`` (the ``NanGuard``
    after ``prepare`` when ``nan_guard`` is on, else None), ``fp8`` (an fp8 recipe's
    ``mixprec.fp8.Fp8Training`` after ``prepare``, else None).
    """

    def __init__(
        self,
        recipe: str | Recipe = "auto",
        device: str | torch.device | None = None,
        *,
        scaler: GradScaler | dict[str, Any] | None = None,
        fp32_modules: Sequence[Rule] = (),
        accumulate: int = 1,
        track_grad_norm: bool = False,
        skip_nonfinite: bool = False,
        fp32_params: Sequence[Any] | None = None,
        nan_guard: bool | str | dict[str, Any] = False,
        fp8: Any = None,
        attention: str | None = None,
    ) -> None:
        self.device = as_device(device)
        self.recipe = with_attention(as_requested(resolve_recipe(recipe, self.device), recipe), attention)  # (an alias says so)
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        self.accumulate = accumulate
        self.track_grad_norm = track_grad_norm
        self.fp32_modules = tuple(as_rules(fp32_modules))
        self.scaler = scaler_for(self.recipe, self.device, scaler, skip_nonfinite)
        self.nan_guard = _check_nan_guard(nan_guard)
        self.guard = None
        self._micro = 0
        self._steps = 0
        self._loss_sum: torch.Tensor | None = None
        self._warned_16bit_loss = False
        self._one: torch.Tensor | None = None
        self._false: torch.Tensor | None = None
        self.masters: MasterWeights | None = None
        self._model_ref: Any = None  # a weakref to the last prepared model
        self._held = ModelsHeld()  # every model prepared: step() refuses optimizers over none of them
        self._families: dict[str, dict[str, int]] = {}  # family -> class -> count, from prepare
        self._dist: Any = None  # mixprec.distributed.runtime.Parallel after prepare(parallel=...), else None
        if self.recipe.stores_16bit:
            rule = self.recipe.fp32_params if fp32_params is None else tuple(as_rules(fp32_params))
            self.masters = make_masters(self.recipe.master, self.policy.param_dtype, rule)
        elif fp32_params is not None:
            raise ValueError(
                f"fp32_params applies to recipes that store parameters in 16 bits; {self.recipe.name!r} "
                "stores them in fp32. Use fp32_modules= for fp32 compute islands."
            )
        self.fp8_spec, self.fp8 = self.recipe.fp8, None  # (after prepare: the fp8 layers and their state)
        if fp8 is not None:
            from mixprec.fp8.state import with_options  # a capability: imported when an option asks for it
            self.fp8_spec = with_options(self.recipe, fp8)

    @property
    def policy(self):
        return self.recipe.policy

    # ------------------------------------------------------------------ model

    def prepare(self, model: nn.Module, parallel: Any = None) -> nn.Module:
        """Apply the recipe to ``model`` in place and return it: fp32 islands and the output cast.

        ``parallel``: None (one process), ``"ddp"``, ``"fsdp"`` or a ``mixprec.distributed.DDP`` /
        ``FSDP``: returns the model wrapped in DDP or FSDP2, gradients reduced in fp32 (call it on
        every rank; docs/distributed.md). Raises ValueError when the model's parameters are not
        where/what the recipe expects (on another device, or cast to 16 bits with ``model.half()``).
        """
        if parallel is None:
            return self._prepare(model)
        from mixprec.distributed.prepare import plug  # a capability: the strategy (mixprec.seam), loaded when asked for
        plugged = plug(model, parallel, Local(self.recipe, self.device, self.scaler, self.accumulate, self.fp32_modules,
                                              self.masters, self._prepare, self._dist is not None, self.fp8_spec,
                                              lambda: self.fp8))
        self._dist, self.masters = plugged.strategy, plugged.masters
        return plugged.model

    def _prepare(self, model: nn.Module, *, check_params: bool = True, masters: bool = True) -> nn.Module:
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare() expects an nn.Module, got {type(model).__name__}")
        if getattr(model, "_mixprec_recipe", None) is not None:
            if model._mixprec_recipe == self.recipe.name:  # type: ignore[attr-defined]
                return model
            raise ValueError(
                f"model was already prepared for recipe {model._mixprec_recipe!r}; "  # type: ignore[attr-defined]
                f"build a fresh model to prepare it for {self.recipe.name!r}"
            )
        if check_params:
            check_model_params(model, self.device, self.recipe, self.masters is not None)
        self._families = {f: family_matches(model, f) for f in (*self.recipe.fp32_modules, *self.fp32_modules)
                          if isinstance(f, str) and f in FAMILIES}
        islands: list[str] = []
        if self.recipe.autocast:
            islands = keep_fp32(model, [*self.recipe.fp32_modules, *self.fp32_modules], self.device.type)
            if self.recipe.pure:
                cast_floating_buffers(model, self.policy.param_dtype)
        elif self.fp32_modules:
            islands = keep_fp32(model, self.fp32_modules, self.device.type)
        if self.fp8_spec is not None:  # after the islands: an island stays fp32
            from mixprec.fp8.state import Fp8Training  # a capability: imported when a recipe asks for it

            self.fp8 = Fp8Training.attach(model, self.fp8_spec, self.device, self.recipe.name)
        if self.masters is not None and masters:
            self.masters.fp32_params += island_param_rules(model, islands)  # an island computes in fp32: its parameters too
            self.masters.attach(model)
            if self.recipe.autocast:  # 16-bit weights: eval loops, generate(), a submodule run outside mp.autocast() too
                autocast_outside(model, self.device.type, self.policy.compute_dtype, root=False)
        if self.recipe.autocast:  # the output cast (and a pure recipe's input cast, a storage recipe's autocast)
            model.forward = PreparedForward(model, self.policy.output_dtype, **prepared_forward_options(self))  # type: ignore[method-assign]
        self.attention = install_attention(model, self.recipe, self.device)  # fp32 attention where asked for
        model._mixprec_recipe = self.recipe.name  # type: ignore[attr-defined]
        self._model_ref = weakref.ref(model)  # reset() clears its gradients
        self._held.add(model)
        if self.nan_guard:
            from mixprec.diagnostics.guard import NanGuard  # a tool: imported only when asked for

            # attached last, so its hooks see the islands' casts; the scaler tells it which
            # backward overflows are the scaler's own probing (reported, never raised)
            self.guard = NanGuard.from_flag(model, self.nan_guard, scaler=self.scaler)
            self.guard.attach()
        return model

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """What to build the optimizer over: ``model.parameters()``, except that recipes storing
        parameters in 16 bits give their fp32 masters instead (``torch.optim.AdamW(mp.parameters(model))``)."""
        return [p for _, p in self.named_parameters(model)]

    def named_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` pairs for optimizer param groups (e.g. no weight decay on biases)."""
        if self._dist is not None:
            model = self._dist.local_module(model)
        if self.masters is None:
            return list(model.named_parameters())
        return list(self.masters.named_parameters(model))

    def autocast(self) -> torch.autocast:
        """The compute policy as a context manager (disabled for recipes that do not autocast)."""
        return torch.autocast(self.device.type, dtype=self.policy.compute_dtype, enabled=self.recipe.autocast)

    # ------------------------------------------------------------------ the step

    def _check_loss(self, loss: Any) -> torch.Tensor:
        loss32, sixteen = check_loss(loss)
        if sixteen and not self._warned_16bit_loss:
            self._warned_16bit_loss = True
            warnings.warn(
                f"the loss reached step() in {short_name(loss.dtype)}: its reduction ran in 16 bits. "
                "Compute the loss in fp32: call the loss function outside mp.autocast(), or on "
                "outputs of a prepared model (which casts them to fp32).",
                stacklevel=3,
            )
        return loss32

    def _constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._one is None:
            self._one = torch.ones((), device=self.device)
            self._false = torch.zeros((), dtype=torch.bool, device=self.device)
        assert self._false is not None
        return self._one, self._false

    def step(self, loss: torch.Tensor, optimizers: Optimizers, *, max_grad_norm: float | None = None,
             norm_type: float = 2.0, parameters: Iterable[torch.Tensor] | None = None, scheduler: Any = None,
             retain_graph: bool = False) -> StepStats:
        """Backward and (every ``accumulate`` calls) one optimizer step, in the only correct order.

        Args:
            loss: the scalar loss of this (micro-)batch, preferably fp32.
            optimizers: one optimizer or several; they share the skip decision and one ``update``.
            max_grad_norm: clip the total norm of the unscaled gradients to this.
            norm_type: the norm for clipping / tracking.
            parameters: what to clip (default: every parameter the optimizers hold).
            scheduler: an lr scheduler (or a list) stepped only when the optimizer step was taken.
                With fused optimizers, deciding that costs one host sync.
            retain_graph: passed to ``backward``.
        """
        opts = _as_optimizers(optimizers)
        _check_max_grad_norm(max_grad_norm)
        _check_schedulers(scheduler)
        self._check_prepared()
        if self.masters is None:  # (the masters check their optimizers themselves)
            self._held.check(opts)
        loss32 = self._check_loss(loss)
        try:
            micro = loss32 / self.accumulate if self.accumulate > 1 else loss32
            if self._dist is None:
                self.scaler.scale(micro).backward(retain_graph=retain_graph)
            else:  # gradients are communicated at the boundary only
                self._dist.backward(self.scaler.scale(micro), boundary=self._micro + 1 >= self.accumulate,
                                    accumulating=self.accumulate > 1, retain_graph=retain_graph)
            detached = micro.detach()
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
            self._micro += 1
            self.after_backward(opts, boundary=self._micro >= self.accumulate)
            one, false = self._constants()
            if self._micro < self.accumulate:
                scale = self.scaler.scale_tensor
                return StepStats(loss32.detach(), None, one if scale is None else scale, false, False, self._steps)

            window_loss, self._loss_sum, self._micro = self._loss_sum, None, 0
            self.unscale_(opts)
            grad_norm = self._clip_or_measure(opts, parameters, max_grad_norm, norm_type)  # (checked above)
            return self.optimizer_step(opts, scheduler=scheduler, loss=window_loss, grad_norm=grad_norm)
        except BaseException:  # KeyboardInterrupt too: whatever the user's loop does next must work
            self.reset(opts)
            raise

    def reset(self, optimizers: Optimizers | None = None) -> None:
        """Discard the accumulation window and any step in progress: every gradient (of
        ``optimizers``' parameters, of the prepared model, and the 16-bit ones waiting for the
        masters), the micro-step counter and window loss, and the scaler's record of the step
        (which optimizers it unscaled, what inf checks it made). The loss scale, the masters and
        the optimizer state stay as they are: the next ``step`` starts a fresh window (under ``parallel=``
        it keeps its place, and the next decision says so on every rank: docs/distributed.md).

        ``step`` calls it when it raises (a failing backward, a hook, the optimizer, a
        KeyboardInterrupt), so the failed micro-batch leaves nothing behind and the next step does
        not raise "unscale_() has already been called". Call it yourself after an exception
        outside ``step`` (in the forward, between micro-steps). Parameters an optimizer had already
        updated before the exception stay updated.
        """
        self.scaler.discard_step()
        if self.masters is not None:
            self.masters.abort_step()
        for opt in _as_optimizers(optimizers) if optimizers is not None else ():
            opt.zero_grad(set_to_none=True)
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            model.zero_grad(set_to_none=True)
        # under parallel=, the strategy says what this means for the other ranks, and where the window goes
        # on from: the place it has on the other ranks (docs/distributed.md)
        self._micro, self._loss_sum = 0 if self._dist is None else self._dist.discard(self._steps), None

    def _check_prepared(self) -> None:
        if self.masters is not None and self.masters._model is None:
            raise RuntimeError(
                f"recipe {self.recipe.name!r} stores weights in 16 bits and trains fp32 masters, which "
                "prepare() creates: call model = mp.prepare(model) before training, and build the optimizer "
                "over mp.parameters(model)"
            )

    # The step's parts, for a framework that owns backward and optimizer.step (mixprec.integrations):
    # backward of mp.scaler.scale(loss), after_backward; at the boundary unscale_, clip_grad_norm_,
    # optimizer_step. step() is these parts in this order: both paths compute the same numbers.
    def after_backward(self, optimizers: Optimizers, *, boundary: bool = True) -> None:
        """After each backward of a scaled loss: 16-bit storage recipes move the 16-bit gradients
        onto the fp32 masters (adding in fp32), at the ``boundary`` ready for the step; there, refuses a
        model cast since ``prepare`` (``model.half()``: the step would train another precision)."""
        if boundary:
            self._held.check_storage(self.recipe.name)
        if self.masters is None:
            return
        # nothing reads the gradients before the step but the scaler's inf check and the clip,
        # which can read them 16-bit: a bucketed step may keep them so until each bucket's turn
        # (not with parallel=: the fp32 master gradients are averaged over the ranks at the boundary)
        self.masters.after_backward(_as_optimizers(optimizers), boundary=boundary,
                                    defer=self._scaler_defers() and self._dist is None)
        if self._dist is not None and boundary:
            self._dist.reduce_master_grads(self.masters.named_parameters())

    def unscale_(self, optimizers: Optimizers) -> None:
        """At the boundary, after ``after_backward``: unscale every optimizer's gradients, check
        them for inf/NaN, and make one overflow anywhere skip every optimizer."""
        opts = _as_optimizers(optimizers)
        for opt in opts:  # before clipping: clip the true gradients, not scaled ones
            if self.masters is not None and self.masters.deferred and self.scaler.is_enabled():
                # 16-bit gradients waiting for their bucket: checked now, unscaled when made fp32
                pending = self.masters.pending_grads(opt)
                self.masters.set_grad_unscale(self.scaler.unscale_deferred_(opt, pending), pending,
                                              exact=self.scaler.scale_is_power_of_two)
            else:
                self.scaler.unscale_(opt)
        # one skip decision for every optimizer, and with parallel= for every rank (a MAX all-reduce that
        # also checks that the ranks are in step)
        if self._dist is None:
            self.scaler.share_skip_decision(opts)
        else:
            self._dist.share_skip_decision(self.scaler, opts, self._steps)

    def clip_grad_norm_(self, optimizers: Optimizers, max_norm: float | None, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor | None:
        """After ``unscale_``: clip the unscaled (master) gradients of ``parameters`` (default: the
        optimizers') to ``max_norm``; their norm before clipping. None: measure if ``track_grad_norm``."""
        _check_max_grad_norm(max_norm)
        return self._clip_or_measure(_as_optimizers(optimizers), parameters, max_norm, norm_type)

    def optimizer_step(self, optimizers: Optimizers, *, scheduler: Any = None, loss: torch.Tensor | None = None,
                       grad_norm: torch.Tensor | None = None) -> StepStats:
        """Step every optimizer or skip them all, update the scale, write masters back, zero the
        gradients, step ``scheduler`` if the step was taken. ``loss``/``grad_norm``: for the stats."""
        opts, scaler, masters = _as_optimizers(optimizers), self.scaler, self.masters
        if masters is None:
            for opt in opts:
                scaler.step(opt)
        else:  # a 16-bit storage recipe may step (and write back) its masters a bucket at a time
            with masters.bucketed_step(opts):
                for opt in opts:
                    scaler.step(opt)
        scaler.update()
        if masters is not None:  # stepped (or skipped: unchanged) masters -> 16-bit model
            masters.after_step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        self._steps += 1
        if scheduler is not None and not scaler.was_skipped():
            for s in scheduler if isinstance(scheduler, (list, tuple)) else (scheduler,):
                s.step()
        if scaler._enabled:  # the summed found_inf: StepStats makes the flag only when it is read
            scale, skipped = scaler.last_scale, scaler._last_found_inf
        else:
            scale, skipped = self._constants()
        if self.fp8 is not None:  # delayed scaling's history advances, unless the step was skipped
            self.fp8.after_step(scaler.last_skipped if scaler._enabled else None, self._dist)
        loss = torch.full((), float("nan"), device=self.device) if loss is None else loss
        if self._dist is not None:  # the step is done on this rank
            self._dist.stepped()
        return StepStats(loss, grad_norm, scale, skipped, True, self._steps)

    def _scaler_defers(self) -> bool:
        """Whether the scaler can check 16-bit gradients that wait for their bucket (``unscale_deferred_``):
        off, or mixprec's own scaler as it reads gradients (a subclass that replaces ``unscale_``,
        ``_unscale_grads_`` or ``step`` may read every gradient: those get fp32 ones after backward)."""
        if not self.scaler.is_enabled():
            return True
        cls = type(self.scaler)
        return all(getattr(cls, name, None) is getattr(GradScaler, name)
                   for name in ("unscale_", "_unscale_grads_", "step", "unscale_deferred_"))

    def _clip_or_measure(
        self,
        opts: list[torch.optim.Optimizer],
        parameters: Iterable[torch.Tensor] | None,
        max_grad_norm: float | None,
        norm_type: float,
    ) -> torch.Tensor | None:
        if max_grad_norm is None and not self.track_grad_norm:
            return None
        params = list(parameters) if parameters is not None else [
            p for o in opts for g in o.param_groups for p in g["params"]
        ]
        if self.masters is not None:  # the 16-bit parameters' gradients now live on their masters
            params = self.masters.optimizer_view(params)
            if self.masters.deferred:  # ... or still on the model, until their bucket steps
                return self.masters.deferred_grad_norm_(params, max_grad_norm, norm_type)
        if self._dist is not None:  # the norm over every rank's gradients (FSDP2's are shards)
            return self._dist.clip_grad_norm_(params, max_grad_norm, norm_type)
        return clip_dense_or_sparse(params, max_grad_norm, norm_type)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The recipe name, the scaler's state and the step counters.

        Raises RuntimeError inside an accumulation window: the accumulated gradients live in
        ``.grad`` and would be lost.
        """
        if self._micro != 0:
            raise RuntimeError(
                f"state_dict() called in the middle of an accumulation window (micro-step {self._micro} "
                f"of {self.accumulate}): the gradients accumulated so far live in .grad and would not be "
                "saved. Save after a step() that returned stepped=True."
            )
        state = {"recipe": self.recipe.name, "scaler": self.scaler.state_dict(), "steps": self._steps}
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        if self.fp8 is not None:
            state["fp8"] = self.fp8.state_dict()
        if self._dist is not None:
            state["parallel"] = self._dist.state()
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore from ``state_dict()``. With ``strict``, the recipe must be the same.

        Every part (recipe, scaler, masters, fp8 state, steps) is checked before any is applied, so a
        state that is refused (another model's, a damaged or edited one) leaves this object, the model
        and the scaler as they were; a part that still fails while applied (a custom scaler's own load)
        puts back the parts applied before it.
        """
        steps = check_loadable(self, state, strict)
        scaler_before = self.scaler.state_dict()
        fp8_before = self.fp8.state_dict() if self.fp8 is not None else None
        try:  # the masters last: they are the one part too large to copy aside, and checked already
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            if self.fp8 is not None or state.get("fp8"):
                from mixprec.fp8.state import load_fp8_state  # (refuses fp8 state before prepare)
                load_fp8_state(self, state.get("fp8"), state.get("recipe"), steps)
            if self.masters is not None and "masters" in state:
                self.masters.load_state_dict(state["masters"])
        except BaseException:
            if scaler_before:
                self.scaler.load_state_dict(scaler_before)
            if fp8_before is not None:
                self.fp8.load_state_dict(fp8_before)  # type: ignore[union-attr]
            raise
        self._steps = steps
        self._micro, self._loss_sum = 0, None
        if self._dist is not None:  # (every rank loads the same checkpoint: they are in step again)
            self._dist.loaded()

    def fp32_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``model.state_dict()`` in fp32: the masters' values in place of 16-bit weights, tied names
        sharing one tensor. To resume exactly, save ``mp.state_dict()`` too."""
        return export.fp32_state_dict(self, model)

    def save_pretrained(self, model: nn.Module, save_directory: Any, **kwargs: Any) -> None:
        """A Hugging Face model's fp32 export that ``from_pretrained(dir)`` reloads in fp32, exactly."""
        export.save_pretrained(self, model, save_directory, **kwargs)

    def describe(self) -> str:
        """A few lines saying what this object will do (and, after prepare, what it matched)."""
        return describe(self)

    def __repr__(self) -> str:
        return f"MixedPrecision({self.recipe.name!r}, device={str(self.device)!r})"
