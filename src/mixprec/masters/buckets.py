"""Slots and buckets: how the master-weight strategies lay out the per-step work, and the bucketed step.

A ``_Slot`` pairs one 16-bit model parameter with the fp32 proxy the optimizer holds. The per-step
work runs on **buckets** (``_Bucket``): consecutive slots on one device, up to ``BUCKET_NUMEL``
elements, concatenated into one flat tensor for the step (``_flat``, ``_views``, ``_scatter_``). A
handful of ops per bucket replaces a handful per parameter (a model of 300 tensors paid ~150 us per
tensor for a Kahan write-back on a CPU); the bucket size bounds the temporaries. The model's
parameters stay separate tensors (references, ties and ``load_state_dict`` keep working); only the
strategies' own buffers (Kahan compensation, remainders) are flat per bucket, with one view per
parameter (``_flat_buffer``).

``_StepInBuckets`` is the optimizer's ``step`` while a step runs a bucket at a time
(``MasterWeights.bucketed_step``), ``_showing_only`` the param-group cut it steps under;
``PER_PARAMETER_OPTIMIZERS`` are the optimizers for which that is the same as one whole step.

Relies on torch and ``mixprec._env`` only (no other mixprec module: ``base`` imports this one).
``_StepInBuckets`` drives its owner, a ``MasterWeights`` (``mixprec.masters.base``): its ``buckets``,
``_bucket_of``, ``deferred``, ``pending_grad``, ``_step_bucket``, ``_rewrite_bucket``,
``_fold_bucket_grads`` and ``_ws`` (a ``_Workspace``: the step's temporaries, kept or not).

``BUCKET_NUMEL`` is read when a ``MasterWeights`` is made (and by the memory planner): set it
here, e.g. ``monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._env import workspace_limit, workspace_mode


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
    params_16: torch.Tensor | None = None  # the 16-bit parameters, flat, gathered by a step's rebuild

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


def _flat_buffer(b: _Bucket, name: str, flat: torch.Tensor) -> None:
    """Keep ``flat`` as the bucket's buffer ``name``, with one view of it per slot."""
    b.extra[name] = flat
    for s, v in zip(b.slots, _views(flat, [s.param for s in b.slots])):
        s.extra[name] = v


class _Workspace:
    """The flat temporaries of a bucketed step (the 16-bit parameters gathered, the fp32 values
    rebuilt for the optimizer, the fp32 gradients), kept from bucket to bucket and step to step
    instead of allocated each time, on a CPU, as ``MIXPREC_MASTER_WORKSPACE`` says: "auto" (the
    default) up to ``KEEP_LIMIT_BYTES`` (64 MiB) in all, "keep" all of them, "free" none.

    A fresh buffer of a few MB is a fresh mapping on a CPU (glibc returns large blocks to the
    system), and touching its pages cost ~1 ms of a 16 ms step on the reference block (CUDA's
    caching allocator keeps such blocks already). The buckets run one after another and each
    releases what it used before the next begins, so one buffer per use, as large as the largest
    bucket, serves them all. The price: what is kept (up to one bucket's temporaries, 4-10 B per
    16-bit parameter by strategy, at most ``BUCKET_NUMEL`` of them; under "auto" at most 64 MiB)
    stays allocated through the forward and backward, where it adds to the peak (``mixprec memory``
    counts it: ``kept_bytes`` of each strategy, bounded as here). A buffer that would pass the limit
    is allocated afresh each time, as under "free". ``active`` is set by the bucketed step only;
    elsewhere (a whole step, the fold after an exception) the temporaries are allocated as before.
    The values are the same bits either way.
    """

    def __init__(self) -> None:
        self.mode = workspace_mode()
        self.limit = workspace_limit(self.mode)  # bytes kept at most (None: no limit)
        self.keep = self.limit != 0
        self.active = False
        self.kept_bytes = 0  # what the kept buffers hold now
        self._bufs: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}

    def get(self, use: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A 1-d buffer of ``numel`` elements for ``use`` (its old contents), or None: allocate afresh."""
        if not (self.keep and self.active) or device.type != "cpu":
            return None
        key = (use, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            old = 0 if buf is None else buf.numel() * buf.element_size()
            need = numel * dtype.itemsize
            if self.limit is not None and self.kept_bytes - old + need > self.limit:
                return None  # past the limit: this one is allocated each time (the kept ones stay)
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
            self.kept_bytes += need - old
        return buf[:numel]

    def flat(self, use: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """``_flat(tensors)``, cast to ``dtype`` if given (one pass: the copy casts), in a kept buffer."""
        dtype = tensors[0].dtype if dtype is None else dtype
        out = self.get(use, sum(t.numel() for t in tensors), dtype, tensors[0].device) if self.keep and self.active else None
        if out is None:
            if len(tensors) == 1 and tensors[0].dtype != dtype:
                return tensors[0].reshape(-1).to(dtype)  # (the cast is the copy: no clone first)
            flat = _flat(tensors)
            return flat if flat.dtype == dtype else flat.to(dtype)
        if len(tensors) > 1:
            return torch.cat([t.reshape(-1) for t in tensors], out=out)
        return out.copy_(tensors[0].reshape(-1))

    def describe(self) -> str:
        """For ``mp.describe()``: what is kept, or "" when nothing is."""
        if not self.keep:
            return ""
        held = f", {self.kept_bytes / 2**20:.1f} MiB now" if self.kept_bytes else ""
        if self.limit is None:
            return f"step temporaries kept between steps on a CPU (MIXPREC_MASTER_WORKSPACE=keep{held})"
        return (f"step temporaries kept between steps on a CPU up to {self.limit / 2**20:.0f} MiB "
                f"(MIXPREC_MASTER_WORKSPACE=auto{held}; =free releases them)")


class _StepInBuckets:
    """While active, ``optimizer.step(...)`` runs once per bucket (the optimizer's parameters
    outside any bucket, fp32-kept ones, step with the first), each time with ``param_groups`` cut
    down to that part; the instance ``step`` it replaces (an lr scheduler's counter) is what it calls."""

    def __init__(self, owner: Any, opt: torch.optim.Optimizer) -> None:
        # owner: the MasterWeights (mixprec.masters.base) stepping; not imported, base imports this module
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
        rest = parts[-1]  # parameters the strategy does not store (fp32-kept, other models')
        self.called = True
        owner._ws.active = True  # the buckets run one after another: their temporaries are kept
        try:
            return self._each_bucket(parts, rest, args, kwargs)
        finally:
            owner._ws.active = False

    def _each_bucket(self, parts: list[list[list[torch.Tensor]]], rest: list[list[torch.Tensor]] | None,
                     args: tuple, kwargs: dict) -> Any:
        owner, opt, out = self.owner, self.opt, None
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
