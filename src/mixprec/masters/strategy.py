"""Master-weight strategies: 16-bit parameter storage that still trains like fp32.

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

The per-step work runs on **buckets**: consecutive parameters on one device, up to
``BUCKET_NUMEL`` elements, concatenated into one flat tensor for the step. A handful of ops per
bucket replaces a handful per parameter (a model of 300 tensors paid ~150 us per tensor for a
Kahan write-back on a CPU); the bucket size bounds the temporaries. The model's parameters stay
separate tensors (references, ties and ``load_state_dict`` keep working); only the strategies' own
buffers (Kahan compensation, remainders) are flat per bucket, with one view per parameter.

A skipped step (inf/NaN gradients) leaves proxies as they were, and writing back an unchanged
value changes nothing in any strategy (Kahan is a no-op on zero updates): skipped steps leave
masters, model and optimizer state bitwise unchanged without a host sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.masters.guard import built_over_16bit, install_guard, unfrozen_after_prepare
from mixprec.masters.rounding import join_fp32, kahan_add_, split_fp32, stochastic_round_bf16
from mixprec.masters.rules import ParamRule, fp32_param_names


@dataclasses.dataclass
class _Slot:
    name: str
    param: nn.Parameter  # the model's parameter, stored in 16 bits
    proxy: nn.Parameter  # what the optimizer holds: always fp32
    placeholder: torch.Tensor  # the proxy's zero-byte value between steps (kept: re-expanding costs ~4 us)
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # compensation, remainder


#: Elements per bucket: the flat temporaries of one bucket's step (a few bytes per element) stay
#: below a few hundred MB; a parameter larger than this is a bucket of its own.
BUCKET_NUMEL = 1 << 24

#: Optimizers (exact classes: a subclass may look across parameters) whose update of a parameter
#: depends only on that parameter, its gradient and its own state: stepping their parameters a
#: bucket at a time gives bitwise the same result as one step over all of them (tested).
PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


@dataclasses.dataclass
class _Bucket:
    """Consecutive slots on one device, processed as one flat tensor in the step."""

    slots: list[_Slot]
    device: torch.device
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # flat strategy buffers
    value_32: torch.Tensor | None = None  # the proxies' flat fp32 values during a step (compact strategies)
    value_ptrs: list[int] = dataclasses.field(default_factory=list)  # where each proxy's view of it starts

    numel: int = 0  # elements of all its slots


def _buckets(slots: Sequence[_Slot], limit: int) -> list[_Bucket]:
    out: list[_Bucket] = []
    for s in slots:
        b = out[-1] if out else None
        if b is None or b.device != s.param.device or b.numel + s.param.numel() > limit:
            out.append(_Bucket([], s.param.device))
        out[-1].slots.append(s)
        out[-1].numel += s.param.numel()
    return out


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-d tensor holding ``tensors`` back to back (a copy; a lone tensor's flat view is copied too)."""
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped like ``like`` (the inverse of ``_flat``)."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like)]


def _scatter_(dst: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` back into the separate tensors ``dst`` (one foreach op)."""
    torch._foreach_copy_(list(dst), _views(flat, dst))


class _StepInBuckets:
    """While active, ``optimizer.step(...)`` runs once per bucket (the optimizer's parameters
    outside any bucket, fp32-kept ones, step with the first), each time with ``param_groups`` cut
    down to that part; the instance ``step`` it replaces (an lr scheduler's counter) is what it calls."""

    def __init__(self, owner: "MasterWeights", opt: torch.optim.Optimizer) -> None:
        self.owner, self.opt = owner, opt
        self.called = False  # the scaler called the optimizer (it does not on a skipped step)
        self.saved = opt.__dict__.get("step")
        self.inner = self.saved if self.saved is not None else type(opt).step.__get__(opt)

    def __enter__(self) -> "_StepInBuckets":
        self.opt.step = self  # type: ignore[method-assign]
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.saved is None:
            del self.opt.step
        else:
            self.opt.step = self.saved  # type: ignore[method-assign]
        owner = self.owner
        if exc_type is not None and owner.deferred:
            # The step failed part-way: the buckets it did not reach still have their gradients on
            # the 16-bit model. Fold them onto the masters, where a whole step would have put them
            # (so optimizer.zero_grad() clears them and the next backward does not add to them),
            # unscaled and clipped as a whole step would have left them.
            with torch.no_grad():
                for b in owner.buckets:
                    owner._fold_bucket_grads(b)
            owner.deferred = False
        owner._optimizer_called = self.called

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(opt.step) sees the real one
        return self.inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner, opt = self.owner, self.opt
        where = owner._bucket_of
        parts: list[list[list[torch.Tensor]]] = [[[] for _ in opt.param_groups] for _ in range(len(owner.buckets) + 1)]
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                parts[where.get(id(p), -1)][gi].append(p)
        out = None
        rest = parts[-1]  # parameters the strategy does not store (fp32-kept, other models')
        self.called = True
        for b, groups in zip(owner.buckets, parts):
            if any(owner.pending_grad(p) is not None for part in groups for p in part):
                if rest is not None:  # they step with the first bucket: one optimizer call fewer
                    groups = [part + extra for part, extra in zip(groups, rest)]
                    rest = None
                out = owner._step_bucket(b, opt, groups, self.inner, args, kwargs)
            else:
                owner._rewrite_bucket(b)  # unchanged; a random rounding still draws, in bucket order
        if rest is not None:  # no bucket stepped: the optimizer is still called once, as a whole step would
            with _showing_only(opt, rest):
                out = self.inner(*args, **kwargs)
        return out


@contextlib.contextmanager
def _showing_only(opt: torch.optim.Optimizer, groups: list[list[torch.Tensor]]) -> Iterator[None]:
    """Each of ``opt``'s param groups holds only its part in ``groups`` for the duration."""
    full = [g["params"] for g in opt.param_groups]
    try:
        for g, part in zip(opt.param_groups, groups):
            g["params"] = part
        yield
    finally:
        for g, params in zip(opt.param_groups, full):
            g["params"] = params


class MasterWeights:
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
    #: writing a value back draws random bits even when the value did not change (stochastic
    #: rounding): a bucketed step then writes back the buckets it did not step too
    draws_on_write = False
    description = ""

    def __init__(self, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule]) -> None:
        fmt = get_format(storage_dtype)
        if not fmt.is_16bit:
            raise ValueError(f"master weights store parameters in 16 bits, got {fmt.name}")
        self.storage_dtype = fmt.dtype
        self.fp32_params = tuple(fp32_params)
        self.slots: list[_Slot] = []
        self.fp32_names: list[str] = []
        self._model: nn.Module | None = None
        self._by_param: dict[int, _Slot] = {}
        self._by_proxy: dict[int, _Slot] = {}
        self._bucket_of: dict[int, int] = {}  # id(proxy) -> index of its bucket
        self.stepping = False
        self._placeholders: dict[torch.device, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self.bucket_numel = BUCKET_NUMEL
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
            self._bucket_of = {id(sl.proxy): i for i, b in enumerate(self.buckets) for sl in b.slots}
            start = 0  # buckets hold consecutive slots
            for b in self.buckets:
                self._init_bucket(b, values_32[start:start + len(b.slots)])
                start += len(b.slots)
        self._model = model
        install_guard()

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
        """Raise if an optimizer holds a 16-bit model parameter instead of its fp32 proxy."""
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in self._by_param:
                        raise ValueError(built_over_16bit(self._by_param[id(p)].name, self.storage_dtype))

    # ------------------------------------------------------------------ the step

    def check_frozen(self) -> None:
        """Raise if a parameter frozen at prepare (no master) has received a gradient since."""
        for name, p in self.frozen:
            if p.grad is not None:
                raise RuntimeError(unfrozen_after_prepare(name, self.storage_dtype))

    def after_backward(self, optimizers: Sequence[torch.optim.Optimizer], boundary: bool,
                       defer: bool = False) -> None:
        """Fold 16-bit gradients into fp32 proxy gradients; at a boundary, materialise the proxies.

        With ``defer`` (nothing reads the gradients before the step but the loss scaler's inf
        check and the clip, which ``pending_grads``/``deferred_grad_norm_`` serve from the 16-bit
        ones, unscaled by ``set_grad_unscale`` when the scaler has a scale), a boundary
        that starts a bucketed step with no fp32 gradient accumulated yet folds nothing: each
        bucket's gradients become fp32 in its own step, so the step never holds fp32 gradients
        for the whole model.
        """
        self.check_frozen()
        if boundary:
            self.check_optimizers(optimizers)
            in_parts = self.can_step_in_buckets(optimizers)
            self.deferred = defer and in_parts and all(
                s.proxy.grad is None and (s.param.grad is None or s.param.grad.layout == torch.strided)
                for s in self.slots
            )
            # fp32 masters rebuild nothing: stepping them in parts pays only for deferred gradients
            self.in_buckets = in_parts and (self.value_bytes > 0 or self.deferred)
            self._grad_coef, self._clipped, self._grad_unscale, self._unscaled = None, set(), None, set()
            if self.deferred:
                self.stepping = True
                return
        with torch.no_grad():
            for b in self.buckets:
                self._fold_grads(b.slots)
            if boundary:
                if not self.in_buckets:
                    for b in self.buckets:
                        self._materialize_bucket(b)
                self.stepping = True

    def _fold_grads(self, slots: Sequence[_Slot], coef: torch.Tensor | None = None,
                    clipped: set[int] | frozenset[int] = frozenset(), unscale: torch.Tensor | None = None) -> None:
        """Move the 16-bit gradients of ``slots`` (one bucket's) into fp32 proxy gradients, times
        ``unscale`` (a loss scaler's inverse scale) and then, those of the slots in ``clipped``
        (ids), times ``coef`` (a clip coefficient): the products the scaler's unscale and the clip
        make on fp32 gradients, in their order. Accumulation across micro-steps adds in fp32."""
        fresh, dense_fresh, accum = [], [], []
        for s in slots:
            g = s.param.grad
            if g is None:
                continue
            if s.proxy.grad is not None:
                accum.append(s)  # accumulation across micro-steps happens in fp32
            elif g.is_sparse or g.layout != torch.strided:
                fresh.append(s)
            else:
                dense_fresh.append(s)
        if dense_fresh:
            # one flat fp32 gradient per bucket; each proxy's .grad is a view of it
            flat = _flat([s.param.grad for s in dense_fresh]).to(torch.float32)
            if unscale is not None:
                flat.mul_(unscale)
            views = _views(flat, [s.param for s in dense_fresh])
            if coef is not None:
                hit = [v for s, v in zip(dense_fresh, views) if id(s) in clipped]
                if len(hit) == len(views):
                    flat.mul_(coef)
                elif hit:
                    torch._foreach_mul_(hit, coef)  # the same multiplication, on the clipped ones only
            for s, g32 in zip(dense_fresh, views):
                s.proxy.grad = g32
        for s in fresh:
            s.proxy.grad = s.param.grad.to(torch.float32)
        if accum:
            torch._foreach_add_([s.proxy.grad for s in accum], [s.param.grad for s in accum])
        for s in (*dense_fresh, *fresh, *accum):
            s.param.grad = None

    def pending_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient an optimizer parameter will step with: a proxy's deferred 16-bit one, or its own."""
        slot = self._by_proxy.get(id(p)) if self.deferred and p.grad is None else None
        return slot.param.grad if slot is not None else p.grad

    def deferred_grad_norm_(self, params: Sequence[torch.Tensor], max_norm: float | None,
                            norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` (``get_total_norm`` when ``max_norm`` is None) over
        ``params`` (proxies and other parameters) while their 16-bit gradients are deferred: each
        16-bit gradient's norm is computed in fp32 without a copy (on CPU bitwise the norm of its
        fp32 value: tested), combined as torch combines them; fp32 gradients are scaled now,
        deferred ones when their bucket is folded (the same multiplication). Under a loss scaler
        (``set_grad_unscale``) a deferred gradient's norm is its scaled norm times the inverse
        scale when the scale is a power of two (bitwise the norm of the unscaled fp32 gradient),
        else the norm of its unscaled fp32 products, made one tensor at a time."""
        items: list[tuple[torch.Tensor, bool]] = []  # (gradient, still 16-bit on the model)
        deferred_slots: set[int] = set()
        for p in params:
            g = self.pending_grad(p)
            if g is not None:
                items.append((g, p.grad is None))
                if p.grad is None:  # a proxy whose 16-bit gradient waits (pending_grad found its slot)
                    deferred_slots.add(id(self._by_proxy[id(p)]))
        if not items:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        first = items[0][0].device
        by_device: dict[torch.device, list[tuple[torch.Tensor, bool]]] = {}
        for g, is16 in items:
            by_device.setdefault(g.device, []).append((g, is16))
        norms: list[torch.Tensor] = []
        with torch.no_grad():
            for dev, group in by_device.items():
                got = torch._foreach_norm([g for g, _ in group], norm_type, dtype=torch.float32)
                if self._grad_unscale is not None:  # the deferred ones are still multiplied by the scale
                    # (only the optimizer's: the scaler unscales no other gradient, fp32 or deferred)
                    scaled = [i for i, (g, is16) in enumerate(group) if is16 and id(g) in self._unscaled]
                    inv = self._grad_unscale.to(dev)
                    if self._unscale_exact:  # x * 2**-k is exact: the scaled norm times 2**-k is the norm
                        if scaled:
                            torch._foreach_mul_([got[i] for i in scaled], inv)
                    else:
                        # Any other scale rounds each product g * inv, so the norm of the rounded
                        # products (what the whole step measures, after unscale_) is not the scaled
                        # norm times inv: measure those products, one fp32 temporary at a time.
                        got = list(got)
                        for i in scaled:
                            got[i] = torch._foreach_norm([group[i][0].to(torch.float32).mul_(inv)], norm_type)[0]
                norms.extend(got)
            total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
            if max_norm is not None:
                coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
                now: dict[torch.device, list[torch.Tensor]] = {}
                for g, is16 in items:
                    if not is16:
                        now.setdefault(g.device, []).append(g)
                for dev, grads in now.items():
                    torch._foreach_mul_(grads, coef.to(dev))
                self._grad_coef, self._clipped = coef, deferred_slots
        return total

    def pending_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The deferred 16-bit gradients of ``optimizer``'s proxies (waiting on the model)."""
        if not self.deferred:
            return []
        out = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                slot = self._by_proxy.get(id(p)) if p.grad is None else None
                if slot is not None and slot.param.grad is not None:
                    out.append(slot.param.grad)
        return out

    def set_grad_unscale(self, inv_scale: torch.Tensor | None, pending: Sequence[torch.Tensor] = (),
                         exact: bool = True) -> None:
        """A loss scaler's inverse scale: deferred gradients are multiplied by it when folded
        (and the norms of ``pending``, the optimizer's ones the scaler checked, when measured), as
        ``unscale_`` multiplies the optimizer's fp32 gradients and no others. ``exact``: the scale
        is a power of two (``GradScaler.scale_is_power_of_two``), so a norm can be unscaled whole."""
        self._grad_unscale = inv_scale
        self._unscaled = {id(g) for g in pending}
        self._unscale_exact = bool(exact)

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

    def _fold_bucket_grads(self, b: _Bucket) -> None:
        """Fold a bucket's deferred 16-bit gradients, unscaled and clipped as this step asks."""
        coef = None if self._grad_coef is None else self._grad_coef.to(b.device)
        unscale = None if self._grad_unscale is None else self._grad_unscale.to(b.device)
        self._fold_grads(b.slots, coef, self._clipped, unscale)

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
        return self._flat_params(b).to(torch.float32)

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
        b.value_32, b.value_ptrs = None, []
        for s in b.slots:
            s.proxy.data = s.placeholder

    def _flat_params(self, b: _Bucket) -> torch.Tensor:
        return _flat([s.param.data for s in b.slots])

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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; also writes the model's 16-bit parameters."""
        if state.get("kind") != self.kind or state.get("storage") != get_format(self.storage_dtype).name:
            raise ValueError(
                f"master-weight state was saved by strategy {state.get('kind')!r} storing "
                f"{state.get('storage')!r}; this recipe uses {self.kind!r} storing "
                f"{get_format(self.storage_dtype).name!r}"
            )
        saved = state["params"]
        names = {s.name for s in self.slots}
        if set(saved) != names:
            missing, unexpected = sorted(names - set(saved)), sorted(set(saved) - names)
            raise ValueError(
                f"master-weight state does not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]} (was it saved with another model or another fp32_params rule?)"
            )
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
            f"fp32: {', '.join(map(_rule_name, self.fp32_params)) or '-'} ({len(self.fp32_names)} tensors)"
            + (f"; {len(self.frozen)} frozen tensors ({sum(p.numel() for _, p in self.frozen):,} params) "
               f"stored in {get_format(self.storage_dtype).name} without masters" if self.frozen else "")
        )


def _rule_name(rule: ParamRule) -> str:
    return rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))


class Fp32Masters(MasterWeights):
    """An fp32 master copy per 16-bit parameter (Apex O2, Megatron): the proxy *is* the master."""

    kind = "fp32"
    extra_bytes = 4
    value_bytes = 0  # the masters are the values: nothing to rebuild, the step runs whole
    temp_bytes = 2  # the flat 16-bit gradients of a bucket, while they become fp32
    description = "fp32 master copy, cast back to the model after each step"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        for s, v in zip(b.slots, values_32):
            s.proxy.data = v
            s.param.copy_(v)

    def _materialize_bucket(self, b: _Bucket) -> None:
        pass  # the masters are the proxies' values already

    def _write_back_bucket(self, b: _Bucket) -> None:
        # round to nearest even, as torch casts; one foreach copy, no flat temporaries
        torch._foreach_copy_([s.param.data for s in b.slots], [s.proxy.data for s in b.slots])

    def _release_bucket(self, b: _Bucket) -> None:
        pass

    def master_value(self, slot: _Slot) -> torch.Tensor:
        return slot.proxy.data

    def extra_tensors(self, slot: _Slot) -> list[torch.Tensor]:
        return [slot.proxy.data]

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"master": slot.proxy.detach()}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        slot.proxy.data.copy_(state["master"])
        slot.param.copy_(slot.proxy.data)


def _flat_buffer(b: _Bucket, name: str, flat: torch.Tensor) -> None:
    """Keep ``flat`` as the bucket's buffer ``name``, with one view of it per slot."""
    b.extra[name] = flat
    for s, v in zip(b.slots, _views(flat, [s.param for s in b.slots])):
        s.extra[name] = v


class KahanMasters(MasterWeights):
    """No master: each update is added to the 16-bit weight with a 16-bit Kahan compensation."""

    kind = "kahan"
    extra_bytes = 2
    temp_bytes = 22  # the compensated addition in fp32
    description = "16-bit weights updated with a 16-bit Kahan compensation buffer"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        super()._init_bucket(b, values_32)
        _flat_buffer(b, "comp", torch.zeros(b.numel, dtype=self.storage_dtype, device=b.device))

    def _write_back_bucket(self, b: _Bucket) -> None:
        p_16 = self._flat_params(b)
        kahan_add_(p_16, b.extra["comp"], torch.sub(self._stepped_values(b), p_16))
        self._store_params(b, p_16)

    def master_value(self, slot: _Slot) -> torch.Tensor:
        # The compensation holds the negated rounding error: the running sum is param - comp.
        return slot.param.to(torch.float32) - slot.extra["comp"].to(torch.float32)

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"param": slot.param.detach(), "comp": slot.extra["comp"]}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        slot.param.copy_(state["param"])
        slot.extra["comp"].copy_(state["comp"])


class StochasticRoundingMasters(MasterWeights):
    """No master: the stepped fp32 value is rounded to bf16 stochastically (unbiased).

    Args:
        seed: seeds one generator per device; ``None`` uses ``torch.initial_seed()`` at attach, so
            runs seeded with ``torch.manual_seed`` differ and repeat. The generator state is saved.
    """

    kind = "sr"
    extra_bytes = 0
    draws_on_write = True
    temp_bytes = 11  # the random bits, the finiteness test and the rounded result
    description = "bf16 weights, stepped in fp32 and stochastically rounded back (unbiased)"

    def __init__(self, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule], seed: int | None = None) -> None:
        super().__init__(storage_dtype, fp32_params)
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self.generators.get(key)
        if g is None:
            seed = self.seed if self.seed is not None else torch.initial_seed()
            g = self.generators[key] = torch.Generator(device=device)
            g.manual_seed(seed % 2**63)
        return g

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        super()._init_bucket(b, values_32)  # the starting point is rounded to nearest: no noise before training
        self._generator(b.device)

    def _write_back_bucket(self, b: _Bucket) -> None:
        self._store_params(b, stochastic_round_bf16(self._stepped_values(b), self._generator(b.device)))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["generators"] = {k: g.get_state() for k, g in self.generators.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key, gen_state in state.get("generators", {}).items():
            self._generator(torch.device(key)).set_state(gen_state)


class RemainderMasters(MasterWeights):
    """An exact fp32 master kept as the bf16 weight plus an int16 remainder (Megatron's trick).

    The model's weight is the master rounded to nearest with ties away from zero (it differs
    from torch's ties-to-even cast only on exact ties): that is what lets 16 extra bits hold
    the rest of the master exactly.
    """

    kind = "remainder"
    extra_bytes = 2
    temp_bytes = 11  # joining and splitting bit patterns
    description = "bf16 weights + int16 remainders = an exact fp32 master"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        high, rem = split_fp32(_flat(values_32))
        self._store_params(b, high)
        _flat_buffer(b, "rem", rem)

    def _materialize_flat(self, b: _Bucket) -> torch.Tensor:
        return join_fp32(self._flat_params(b), b.extra["rem"])

    def _write_back_bucket(self, b: _Bucket) -> None:
        high, rem = split_fp32(self._stepped_values(b))
        self._store_params(b, high)
        b.extra["rem"].copy_(rem)

    def master_value(self, slot: _Slot) -> torch.Tensor:
        return join_fp32(slot.param.data, slot.extra["rem"])

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"master": self.master_value(slot)}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        high, rem = split_fp32(state["master"].to(device=slot.param.device, dtype=torch.float32))
        slot.param.copy_(high)
        slot.extra["rem"].copy_(rem)


class NearestMasters(MasterWeights):
    """No master and no compensation: round to nearest after each step. UNSAFE, a baseline.

    The optimizer still steps in fp32 with fp32 state; only the weight is rounded. Any update
    smaller than half a 16-bit ulp of its weight (relative 2**-9 for bf16) is lost entirely.
    """

    kind = "nearest"
    extra_bytes = 0
    description = "16-bit weights rounded to nearest after each step, no master (small updates vanish)"

    def _write_back_bucket(self, b: _Bucket) -> None:
        self._store_params(b, self._stepped_values(b))  # the copy rounds to nearest even


STRATEGIES: dict[str, type[MasterWeights]] = {
    cls.kind: cls for cls in (Fp32Masters, KahanMasters, StochasticRoundingMasters, RemainderMasters, NearestMasters)
}


def make_masters(kind: str, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule]) -> MasterWeights:
    """The strategy a recipe names (``Recipe.master``)."""
    cls = STRATEGIES.get(kind)
    if cls is None:
        raise ValueError(f"unknown master-weight strategy {kind!r}; expected one of {sorted(STRATEGIES)}")
    return cls(storage_dtype, fp32_params)
