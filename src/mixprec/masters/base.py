"""``MasterWeights``: the base of the master-weight strategies, and the step contract.

How the pieces meet (the contract ``MixedPrecision`` relies on):

- ``attach(model)`` (from ``prepare``) stores every eligible parameter in 16 bits *in place* (the
  same ``nn.Parameter`` objects, so ties and references survive) and creates, for each, an fp32
  **proxy** ``nn.Parameter``. ``parameters(model)`` yields the proxies in place of the 16-bit
  parameters; the user builds the optimizer over them, so every torch optimizer keeps its state
  in fp32 and can never see a 16-bit weight.
- ``after_backward(optimizers, boundary)`` (after every backward) folds the 16-bit gradients into
  the proxies' fp32 gradients (accumulation windows add in fp32), frees the 16-bit ones, and at
  an optimizer boundary gives every proxy its fp32 value. The loss scaler then unscales fp32
  gradients, clipping sees fp32 gradients, the optimizer steps fp32 values.
- ``after_step()`` (after the scaler's update) writes each proxy back into 16-bit storage, the
  strategy's way, and releases what was only needed for the step.

The compact strategies step **one bucket at a time** when they can (``bucketed_step``, around
the scaler's ``step`` call): a bucket's fp32 values are rebuilt, the optimizer steps only that
bucket's masters, the result is written back to 16 bits and the bucket's fp32 values and gradients
are freed before the next. With ``accumulate=1`` every strategy, fp32 masters included, also
leaves the 16-bit gradients on the model until their bucket's turn (a loss scaler checks them
there: ``GradScaler.unscale_deferred_``). The step then holds the 16-bit gradients plus fp32
gradients and values for one bucket, not fp32 for the whole model (the planner's figure). That needs an optimizer for which
stepping parameters in parts is the same as stepping them at once (per-parameter updates:
``PER_PARAMETER_OPTIMIZERS``) and a single optimizer; otherwise every value is rebuilt at the
boundary and the optimizer steps once (the same numbers, more memory).

What a proxy is between steps is the strategy's choice: the fp32 master itself (``fp32``), or a
zero-byte placeholder of the right shape (the compact strategies: their fp32 value exists only
during the step, rebuilt from what they keep).

The per-step work runs on buckets of consecutive parameters, one flat tensor each
(``mixprec.masters.buckets`` says why and how).

A skipped step (inf/NaN gradients) leaves proxies as they were, and writing back an unchanged
value changes nothing in any strategy (Kahan is a no-op on zero updates): skipped steps leave
masters, model and optimizer state bitwise unchanged without a host sync.

This module holds the base class: ``attach``, what the optimizer sees, the bucketed step
(``bucketed_step``, ``_step_bucket``, ``after_step``), the per-strategy hooks (``_init_bucket``,
``_materialize_flat``, ``_write_back_bucket``...) and the state (``state_dict``, ``masters()``,
``nbytes()``, ``describe()``). It relies on ``buckets`` (slots, buckets, ``_StepInBuckets``),
``gradients`` (``_GradFolding``: after_backward and the deferred gradients), ``guard``, ``rules``
and ``mixprec.formats``. The strategies are in ``variants``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format, is_floating_16bit
from mixprec.islands import warn_unmatched_norms
from mixprec.masters import buckets as _layout
from mixprec.masters.buckets import (
    PER_PARAMETER_OPTIMIZERS,
    _Bucket,
    _buckets,
    _flat,
    _scatter_,
    _showing_only,
    _Slot,
    _StepInBuckets,
    _views,
    _Workspace,
)
from mixprec.masters.gradients import _GradFolding
from mixprec.masters.guard import (added_without_master, built_over_16bit, check_masters_state, install_guard,
                                   unfrozen_after_prepare)
from mixprec.masters.kernels import KernelSet
from mixprec.masters.rules import ParamRule, fp32_param_names


class MasterWeights(_GradFolding):
    """Base class: bookkeeping and the step protocol; subclasses say how fp32 values are kept.

    Args:
        storage_dtype: the 16-bit dtype parameters are stored in.
        fp32_params: the rule for parameters that stay fp32 (see ``mixprec.masters.rules``).
    """

    kind = "?"
    #: persistent bytes per 16-bit parameter on top of its own 2 (what the planner uses).
    extra_bytes = 0
    #: fp32 bytes per 16-bit parameter that exist for the whole optimizer step (the gradient).
    step_bytes = 4
    #: fp32 bytes per 16-bit parameter of the value rebuilt for the step: for one bucket at a time
    #: when the step runs in buckets, for every parameter at once otherwise.
    value_bytes = 4
    #: bytes per element of one bucket allocated on top of that, at the worst point of the step
    #: (the flat 16-bit copies, the rounding arithmetic); measured by tests/masters.
    temp_bytes = 2
    #: bytes per element of one bucket kept between steps on a CPU (as MIXPREC_MASTER_WORKSPACE says)
    kept_bytes = 4
    #: writing a value back draws random bits even when the value did not change (stochastic
    #: rounding): a bucketed step then writes back the buckets it did not step too
    draws_on_write = False
    #: the write-back (and rebuild) run ``masters.kernels`` (compiled when it pays)
    uses_kernels = False
    description = ""

    def __init__(self, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule]) -> None:
        fmt = get_format(storage_dtype)
        if not fmt.is_16bit:
            raise ValueError(f"master weights store parameters in 16 bits, got {fmt.name}")
        self.storage_dtype = fmt.dtype
        self.fp32_params = tuple(fp32_params)
        self.slots: list[_Slot] = []
        self.fp32_names: list[str] = []
        self.fp32_by_rule: dict[str, list[str]] = {}
        self._model: nn.Module | None = None
        self._by_param: dict[int, _Slot] = {}
        self._by_proxy: dict[int, _Slot] = {}
        self._bucket_of: dict[int, int] = {}  # id(proxy) -> index of its bucket
        self.stepping = False
        self._placeholders: dict[torch.device, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._ws = _Workspace()  # a bucketed step's flat temporaries, kept on a CPU
        self.bucket_numel = _layout.BUCKET_NUMEL  # read now: a patched value counts
        #: parameters frozen at prepare (requires_grad False): stored in 16 bits, no master
        self.frozen: list[tuple[str, nn.Parameter]] = []
        #: the current step runs a bucket at a time (decided at the boundary, see ``bucketed_step``)
        self.in_buckets = False
        #: ... and its 16-bit gradients stay on the model until their bucket steps (no fp32 copy
        #: of them all): decided at the boundary, see ``after_backward``
        self.deferred = False
        self._optimizer_called = False  # set by a bucketed step's context on exit
        self._grad_coef: torch.Tensor | None = None  # the clip coefficient for deferred gradients
        self._clipped: set[int] = set()  # ... and the slots (ids) it applies to
        self._grad_unscale: torch.Tensor | None = None  # a loss scaler's inverse scale for deferred gradients
        self._unscaled: set[int] = set()  # ... and the 16-bit gradients (ids) the scaler checked: the optimizer's
        self._unscale_exact = True  # ... and whether that inverse scale is a power of two
        self.kernels = KernelSet()  # the compact strategies' update kernels: compiled or eager (masters.kernels)

    # ------------------------------------------------------------------ attach

    def attach(self, model: nn.Module) -> None:
        """Store eligible parameters of ``model`` in 16 bits and create their fp32 proxies."""
        if self._model is not None and self._model is not model:
            raise ValueError(
                f"this MixedPrecision already stores the parameters of a {type(self._model).__name__} "
                "with master weights; use one MixedPrecision per model for 16-bit storage recipes"
            )
        keep = set(fp32_param_names(model, self.fp32_params))
        self.fp32_names = sorted(keep)
        # per rule item, what it kept (describe() says it): a family that matched nothing is visible
        self.fp32_by_rule = {_rule_name(r): fp32_param_names(model, [r]) for r in self.fp32_params}
        if "norms" in self.fp32_params and not self.fp32_by_rule.get("norms"):
            warn_unmatched_norms(model, "parameters kept fp32")
        values_32: list[torch.Tensor] = []  # per slot, in order: the fp32 value before storage
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in keep or not p.is_floating_point():
                    continue
                if not p.requires_grad:
                    # Frozen (a fine-tuned model's base): it never changes, so it needs no master,
                    # no fp32 gradient and no optimizer state; 16 bits are all it costs.
                    p.data = p.data.to(self.storage_dtype)
                    p._mixprec_role = ("frozen", self, name)  # type: ignore[attr-defined]
                    self.frozen.append((name, p))
                    continue
                placeholder = self._placeholder(p)
                proxy = nn.Parameter(placeholder, requires_grad=p.requires_grad)
                slot = _Slot(name, p, proxy, placeholder)
                values_32.append(p.detach().clone())
                p.data = p.data.to(self.storage_dtype)
                p._mixprec_role = ("stored", self, name)  # type: ignore[attr-defined]
                proxy._mixprec_role = ("proxy", self, name)  # type: ignore[attr-defined]
                self.slots.append(slot)
                self._by_param[id(p)] = slot
                self._by_proxy[id(proxy)] = slot
            self.buckets = _buckets(self.slots, self.bucket_numel)
            self.kernels.size_to(sum(s.param.numel() for s in self.slots))
            self._bucket_of = {id(sl.proxy): i for i, b in enumerate(self.buckets) for sl in b.slots}
            start = 0  # buckets hold consecutive slots
            for b in self.buckets:
                self._init_bucket(b, values_32[start:start + len(b.slots)])
                start += len(b.slots)
        self._model = model
        # what an optimizer of this model holds: the proxies and the parameters kept in fp32
        self._ours = {id(s.proxy) for s in self.slots} | {id(p) for p in model.parameters() if id(p) not in self._by_param}
        install_guard()
        # model.load_state_dict(...) after prepare (a pretrained checkpoint, a resume that forgot
        # mp.load_state_dict) must reach the masters too, or the next step writes them back over it
        self._loading: dict[int, torch.Tensor] = {}
        model.register_load_state_dict_pre_hook(self._catch_load)
        model.register_load_state_dict_post_hook(self._apply_load)

    # ------------------------------------------------------------------ model.load_state_dict

    def _catch_load(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                    missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """Before the model loads: keep the incoming values of the 16-bit parameters, in full
        precision (an fp32 checkpoint's values, before the copy into 16 bits rounds them)."""
        if module is not self._model:
            return
        if self.stepping:
            error_msgs.append("load_state_dict called in the middle of a mixprec step (after backward, before the "
                              "optimizer step): load before the next forward")
            return
        self._loading = {}
        for s in self.slots:
            value = state_dict.get(prefix + s.name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != s.param.shape:
                continue  # missing, or a mismatch torch reports itself
            if value.dtype == s.param.dtype and torch.equal(value.to(s.param.device), s.param.data):
                continue  # this model's own 16-bit values coming back (mp.load_state_dict holds the masters)
            self._loading[id(s)] = value

    def _apply_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """After the model loaded: the loaded parameters' masters (and the strategy's state) are
        set from the incoming values, as ``prepare`` set them from the model's."""
        loading, self._loading = self._loading, {}
        if not loading:
            return
        with torch.no_grad():
            for b in self.buckets:
                if not any(id(sl) in loading for sl in b.slots):
                    continue
                values = [loading[id(sl)].detach().to(device=sl.param.device, dtype=torch.float32).clone()
                          if id(sl) in loading else self.master_value(sl).clone() for sl in b.slots]
                self._init_bucket(b, values)
                self._release_bucket(b)

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        """A zero-byte fp32 stand-in of ``p``'s shape (one shared scalar, expanded)."""
        zero = self._placeholders.get(p.device)
        if zero is None:
            zero = self._placeholders[p.device] = torch.zeros((), dtype=torch.float32, device=p.device)
        return zero.expand(p.shape)

    # ------------------------------------------------------------------ what the optimizer sees

    def _check_model(self, model: nn.Module | None) -> nn.Module:
        if self._model is None:
            raise RuntimeError("call mp.prepare(model) before asking for its optimizer parameters")
        if model is not None and model is not self._model:
            raise ValueError("this model was not prepared by this MixedPrecision; pass the prepared model")
        return self._model

    def named_parameters(self, model: nn.Module | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        """``model.named_parameters()`` with each 16-bit parameter replaced by its fp32 proxy."""
        for name, p in self._check_model(model).named_parameters():
            slot = self._by_param.get(id(p))
            yield name, (p if slot is None else slot.proxy)

    def optimizer_view(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Map 16-bit model parameters to their proxies (for clipping a user-given parameter list)."""
        return [self._by_param[id(p)].proxy if id(p) in self._by_param else p for p in params]

    def check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Raise if an optimizer holds a 16-bit model parameter instead of its fp32 proxy, or if
        the optimizers hold none of the prepared model's parameters at all (built over another
        module: the model would never train, and the step would say it stepped). An extra
        optimizer for parameters outside the model is fine beside one of the model's."""
        ours = self._ours
        held = False
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in self._by_param:
                        raise ValueError(built_over_16bit(self._by_param[id(p)].name, self.storage_dtype))
                    if is_floating_16bit(p.dtype) and getattr(p, "_mixprec_role", None) is None:
                        # a 16-bit parameter prepare never saw (a module added since, an add_param_group):
                        # the optimizer would step it in 16 bits, without a master
                        raise ValueError(added_without_master(p, opt))
                    held = held or id(p) in ours
        if not held:
            names = ", ".join(type(o).__name__ for o in optimizers)
            raise ValueError(
                f"the optimizer ({names}) holds none of the parameters of the prepared "
                f"{type(self._model).__name__}: it was built over another module (or over parameters "
                "replaced since). Build it over mp.parameters(model) for the prepared model"
            )

    # ------------------------------------------------------------------ the step

    def check_frozen(self) -> None:
        """Raise if a parameter frozen at prepare (no master) has received a gradient since."""
        for name, p in self.frozen:
            if p.grad is not None:
                raise RuntimeError(unfrozen_after_prepare(name, self.storage_dtype))

    def can_step_in_buckets(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether the coming step can run a bucket at a time (see the module docstring)."""
        return len(optimizers) == 1 and type(optimizers[0]) in PER_PARAMETER_OPTIMIZERS

    def bucketed_step(self, optimizers: Sequence[torch.optim.Optimizer]) -> Any:
        """A context for the scaler's ``step(optimizer)`` calls: when this step runs in buckets,
        the optimizer's ``step`` is replaced (on the instance, for the duration) by one that steps
        a bucket at a time, writing each back before the next is rebuilt."""
        if not self.in_buckets:
            return contextlib.nullcontext()
        return _StepInBuckets(self, optimizers[0])

    def _step_bucket(self, b: _Bucket, opt: torch.optim.Optimizer, groups: list[list[torch.Tensor]],
                     step: Any, args: tuple, kwargs: dict) -> Any:
        """Rebuild, step (the optimizer sees only ``groups``: this bucket's part of each param
        group), write back and free one bucket."""
        with torch.no_grad():
            if self.deferred:  # this bucket's gradients become fp32 now (unscaled and clipped, if asked)
                self._fold_bucket_grads(b)
            self._materialize_bucket(b)
        with _showing_only(opt, groups):
            out = step(*args, **kwargs)
        with torch.no_grad():
            self._write_back_bucket(b)
            for s in b.slots:
                s.proxy.grad = None  # the bucket's fp32 gradients go now, not at zero_grad
            self._release_bucket(b)
        return out

    def _rewrite_bucket(self, b: _Bucket) -> None:
        """Write a bucket back unchanged: a no-op, except that stochastic rounding draws its random
        bits as a whole step would (so the two paths stay bitwise the same)."""
        if self.draws_on_write:
            with torch.no_grad():
                self._materialize_bucket(b)
                self._write_back_bucket(b)
                self._release_bucket(b)

    def after_step(self) -> None:
        """Write the stepped fp32 values back into 16-bit storage and release step-only memory.

        After a bucketed step, only what it did not reach is left: buckets the optimizer skipped
        (an overflow with an unfused optimizer) or does not hold have no rebuilt value, and their
        16-bit weights are already what a skipped step leaves.
        """
        # a bucketed step whose optimizer was never called (a skipped step) writes nothing back;
        # stochastic rounding still draws for every bucket, as a whole step does
        with torch.no_grad():
            for b in self.buckets:
                if not self.in_buckets:
                    self._write_back_bucket(b)
                elif not self._optimizer_called:
                    self._rewrite_bucket(b)
                for s in b.slots:
                    s.proxy.grad = None
                    if self.deferred:  # never folded: not stepped (skipped, or not the optimizer's)
                        s.param.grad = None
                self._release_bucket(b)
        self.stepping = self.in_buckets = self.deferred = self._optimizer_called = False
        self._grad_coef, self._clipped, self._grad_unscale, self._unscaled = None, set(), None, set()

    def abort_step(self) -> None:
        """After an exception inside a step: drop every gradient (16-bit and fp32), release what
        was rebuilt for the step and forget its unscale and clip state. Masters keep their values;
        buckets an optimizer had already stepped were written back before the next one began."""
        with torch.no_grad():
            for b in self.buckets:
                for s in b.slots:
                    s.proxy.grad = None
                    s.param.grad = None
                self._release_bucket(b)
        self.stepping = self.in_buckets = self.deferred = self._optimizer_called = False
        self._grad_coef, self._clipped, self._grad_unscale, self._unscaled = None, set(), None, set()

    def _stepped_values(self, b: _Bucket) -> torch.Tensor:
        """The bucket's fp32 values after the optimizer step, flat."""
        if b.value_32 is not None and all(s.proxy.data_ptr() == ptr for s, ptr in zip(b.slots, b.value_ptrs)):
            return b.value_32  # the optimizer stepped the views of the flat buffer in place
        return _flat([s.proxy.data for s in b.slots])  # something replaced a proxy's data: gather it

    # ------------------------------------------------------------------ per strategy

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        """Set the bucket's 16-bit parameters (and the strategy's state) from their fp32 values."""
        for s, v in zip(b.slots, values_32):
            s.param.copy_(v)

    def _materialize_flat(self, b: _Bucket) -> torch.Tensor:
        """The bucket's fp32 values, flat, rebuilt from what the strategy keeps."""
        return self._ws.flat("value32", [b.params_16] if b.params_16 is not None else [s.param.data for s in b.slots],
                             torch.float32)

    def _materialize_bucket(self, b: _Bucket) -> None:
        b.value_32 = self._materialize_flat(b)
        b.value_ptrs = []
        for s, v in zip(b.slots, _views(b.value_32, [s.param for s in b.slots])):
            s.proxy.data = v
            b.value_ptrs.append(v.data_ptr())

    def _write_back_bucket(self, b: _Bucket) -> None:
        """Store the stepped fp32 values (``_stepped_values``) in the bucket's 16-bit parameters,
        the strategy's way."""
        raise NotImplementedError

    def _release_bucket(self, b: _Bucket) -> None:
        b.value_32, b.value_ptrs, b.params_16 = None, [], None
        for s in b.slots:
            s.proxy.data = s.placeholder

    def _flat_params(self, b: _Bucket) -> torch.Tensor:
        if b.params_16 is not None:  # gathered by this step's rebuild
            return b.params_16
        return self._ws.flat("params16", [s.param.data for s in b.slots])

    def _store_params(self, b: _Bucket, flat_16: torch.Tensor) -> None:
        _scatter_([s.param.data for s in b.slots], flat_16)


    def master_value(self, slot: _Slot) -> torch.Tensor:
        """The best fp32 value this strategy knows for a parameter (between steps)."""
        return slot.param.to(torch.float32)

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"param": slot.param.detach()}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        slot.param.copy_(state["param"])

    # ------------------------------------------------------------------ introspection and state

    def masters(self) -> dict[str, torch.Tensor]:
        """name -> fp32 value of each 16-bit parameter (a copy; for tests and inspection)."""
        with torch.no_grad():
            return {s.name: self.master_value(s).clone() for s in self.slots}

    def fp32_state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict()`` with each 16-bit parameter replaced by its master's fp32 value
        (and frozen 16-bit parameters cast up): what the same model trained in fp32 would save, for
        an export (``save_pretrained(dir, state_dict=...)``). Resuming training exactly needs
        ``mp.state_dict()`` beside it (compensation buffers, remainders, generators)."""
        model = self._check_model(None)
        frozen = {id(p) for _, p in self.frozen}
        # every name a parameter goes by (a tied lm_head.weight too), and one fp32 tensor per parameter,
        # so that tied names share it as the model's share one parameter
        source = {n: p for n, p in model.named_parameters(remove_duplicate=False)
                  if id(p) in self._by_param or id(p) in frozen}
        made: dict[int, torch.Tensor] = {}
        out: dict[str, Any] = {}
        with torch.no_grad():
            for key, value in model.state_dict(keep_vars=True).items():
                p = source.get(key)
                if p is not None and id(p) not in made:
                    slot = self._by_param.get(id(p))
                    made[id(p)] = (self.master_value(slot) if slot is not None else p.to(torch.float32)).detach().clone()
                out[key] = made[id(p)] if p is not None else value.detach()
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes held now: 16-bit parameters, fp32 parameters, and the strategy's own state."""
        model = self._check_model(None)
        stored = sum(p.numel() * p.element_size() for p in [*(s.param for s in self.slots), *(p for _, p in self.frozen)])
        keep = set(self.fp32_names)
        fp32 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in keep)
        extra = sum(t.numel() * t.element_size() for s in self.slots for t in self.extra_tensors(s))
        return {"stored_16bit": stored, "fp32_params": fp32, "masters": extra}

    def extra_tensors(self, slot: _Slot) -> list[torch.Tensor]:
        """Tensors this strategy keeps per parameter between steps, beyond the 16-bit parameter."""
        return list(slot.extra.values())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the 16-bit parameters and the strategy's state exactly."""
        return {
            "kind": self.kind,
            "storage": get_format(self.storage_dtype).name,
            "params": {s.name: self._slot_state(s) for s in self.slots},
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError when ``state`` cannot be loaded; writes nothing (``load_state_dict`` runs it first)."""
        check_masters_state(self, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; also writes the model's 16-bit parameters."""
        self.check_state_dict(state)  # every entry checked before any is loaded: a refused state changes nothing
        saved = state["params"]
        with torch.no_grad():
            for s in self.slots:
                self._load_slot_state(s, saved[s.name])
            for b in self.buckets:
                self._release_bucket(b)

    def describe(self) -> str:
        n16 = sum(s.param.numel() for s in self.slots)
        return (
            f"{self.kind}: {self.description}; {len(self.slots)} tensors ({n16:,} params) stored in "
            f"{get_format(self.storage_dtype).name}, +{self.extra_bytes} B/param kept, "
            f"fp32: {', '.join(f'{r} ({len(n)})' for r, n in self.fp32_by_rule.items()) or '-'} "
            f"({len(self.fp32_names)} tensors)"
            + (f"; {len(self.frozen)} frozen tensors ({sum(p.numel() for _, p in self.frozen):,} params) "
               f"stored in {get_format(self.storage_dtype).name} without masters" if self.frozen else "")
            + (f"; update kernels: {self.kernels.describe()}" if self.uses_kernels else "")
            + (f"; {self._ws.describe()}" if self._ws.keep and self.slots and self.slots[0].param.device.type == "cpu" else "")
        )


def _rule_name(rule: ParamRule) -> str:
    return rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))
