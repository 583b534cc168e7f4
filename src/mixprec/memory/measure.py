"""Measure what one real training step holds, component by component, beside the plan.

The same components as ``mixprec.memory.plan``, counted from the tensors that exist (unique storages,
so views and ties count once):

- weights: the model's parameters; masters: the strategy's own tensors (fp32 copies,
  compensation, remainders); optimizer state: every tensor in ``optimizer.state`` after the step.
- gradients: each parameter's ``.grad`` as backward leaves it (a post-accumulate-grad hook).
- activations (+ autocast weight copies): every storage autograd saved for backward during the
  forward and the loss (a saved-tensors hook), minus parameters and masters. Autocast's 16-bit
  weight copies are saved tensors too; they are told apart by matching a parameter's shape (or its transpose),
  and so are the fp8 weight copies an fp8 recipe's linears save (1 B each).
- step-time fp32: what the fp32 masters' gradients and rebuilt values hold when the optimizer
  steps (an optimizer pre-step hook; a step that runs a bucket at a time calls it once per bucket,
  and the most any call saw is reported: gradients are freed bucket by bucket as they are used).
- on CUDA, also ``torch.cuda.max_memory_allocated()`` over the step, less what was allocated
  before the model was built: the real peak of this model's training.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.fp8.conv1d import is_conv1d
from mixprec.instruments.storage import LiveBytes, storage_bytes
from mixprec.masters import fp32_param_names
from mixprec.memory.plan import ParamCounts
from mixprec.recipes import Recipe, as_device, resolve_recipe
from mixprec.tasks import Task, to_device
from mixprec.training import MixedPrecision

_MATMUL = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)  # and Hugging Face's Conv1D (GPT-2's), a matmul too
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_optimizer(name: str, params: Iterable[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """The optimizer the planner names, with kernels that make no full-size temporaries
    (fused on CUDA, per-tensor on CPU), so measured bytes are the state itself."""
    kernel: dict[str, Any] = {"fused": True} if device.type == "cuda" else {"foreach": False}
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, **kernel),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3, **kernel),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, **kernel),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kernel),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-3, foreach=False),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, foreach=False),
    }
    if name.lower() not in makers:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(makers)}")
    return makers[name.lower()]()


def count_params(model: nn.Module, recipe: Recipe) -> ParamCounts:
    """Total floating parameters, those the recipe keeps fp32, the matmul weights, and the frozen ones."""
    params = {id(p): p for p in model.parameters() if p.is_floating_point()}
    kept = frozen_kept = 0
    if recipe.stores_16bit:
        named = dict(model.named_parameters())
        kept_params = [named[n] for n in fp32_param_names(model, recipe.fp32_params)]
        kept = sum(p.numel() for p in kept_params)
        frozen_kept = sum(p.numel() for p in kept_params if not p.requires_grad)
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    largest = 0
    if recipe.stores_16bit:
        kept_ids = {id(p) for p in kept_params}
        largest = max((p.numel() for p in params.values() if p.requires_grad and id(p) not in kept_ids), default=0)
    matmul: dict[int, int] = {}
    for m in model.modules():
        if (isinstance(m, _MATMUL) or is_conv1d(m)) and isinstance(getattr(m, "weight", None), nn.Parameter):
            matmul[id(m.weight)] = m.weight.numel()
        if isinstance(m, nn.MultiheadAttention):
            for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                w = getattr(m, name, None)
                if isinstance(w, nn.Parameter):
                    matmul[id(w)] = w.numel()
    fp8 = None
    if recipe.fp8 is not None:  # the fp8 linears' weights are copied to fp8, 1 B each
        from mixprec.fp8 import decide

        linears = dict(model.named_modules())
        fp8 = sum(linears[d.name].weight.numel() for d in decide(model, recipe.fp8) if d.fp8)
    return ParamCounts(sum(p.numel() for p in params.values()), kept, sum(matmul.values()), frozen, frozen_kept, largest,
                       fp8)


@dataclasses.dataclass
class Measured:
    """Bytes by component (keys as ``mixprec.memory.plan.COMPONENTS``), and the peak of the measured step
    (``peak_allocated``: the CUDA allocator's, or on CPU the tensor storages alive, see ``LiveBytes``)."""

    bytes: dict[str, int]
    counts: ParamCounts
    peak_allocated: int | None = None
    device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "params": dataclasses.asdict(self.counts),
                "peak_allocated": self.peak_allocated, "device": self.device}


def measure_step(task: Task, recipe: str | Recipe, optimizer: str = "adamw", device: str | torch.device | None = "cpu",
                 seed: int = 0, warmup: int = 1) -> Measured:
    """Build ``task``'s model, prepare it for ``recipe``, run ``warmup`` steps, then one more step
    and measure what it held. The warm-up makes the measured step a steady one: the optimizer
    state exists from its start (it is created inside the first ``step()``), as in training.

    The peak: on CUDA the allocator's, over the measured step, of everything allocated since the
    model was built; on CPU the same figure counted by ``LiveBytes`` (tensor storages, no
    allocator slack)."""
    dev = as_device(device)
    if dev.type == "cuda":
        return _measure_step(task, recipe, optimizer, dev, seed, warmup, None)
    with LiveBytes() as live:
        return _measure_step(task, recipe, optimizer, dev, seed, warmup, live)


def _measure_step(task: Task, recipe: str | Recipe, optimizer: str, dev: torch.device, seed: int, warmup: int,
                  live: LiveBytes | None) -> Measured:
    rec = resolve_recipe(recipe, dev)
    cuda = dev.type == "cuda"
    base = 0
    if cuda:  # earlier runs' tensors may wait in reference cycles: collect them, then count from here
        gc.collect()
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
    torch.manual_seed(seed)
    model = task.build_model().to(dev)
    counts = count_params(model, rec)
    mp = MixedPrecision(rec, dev)
    model = mp.prepare(model)
    opt = make_optimizer(optimizer, mp.parameters(model), dev)
    for i in range(warmup):
        w_in, w_tgt = to_device(task.get_batch(1 + i), dev)
        with mp.autocast():
            w_out = task.run_forward(model, w_in)
        mp.step(task.loss_fn(w_out, w_tgt), opt)
        del w_out
    inputs, targets = to_device(task.get_batch(0), dev)

    params = list(model.parameters())
    shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params}  # mm saves weight.t()
    masters = [t for s in mp.masters.slots for t in mp.masters.extra_tensors(s)] if mp.masters else []
    persistent = {t.untyped_storage().data_ptr() for t in [*params, *masters]}
    saved: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, looks like a weight copy)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in persistent:
            is_copy = rec.autocast and not rec.stores_16bit and tuple(t.shape) in shapes and (
                t.dtype == rec.compute_dtype or (rec.fp8 is not None and t.dtype in _FP8))  # an fp8 linear's copy
            saved[st.data_ptr()] = (st.nbytes(), is_copy or saved.get(st.data_ptr(), (0, False))[1])
        return t

    grads: dict[int, int] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(id(p), p.grad.untyped_storage().nbytes()))
             for p in params if p.requires_grad]
    step_time: list[int] = []

    # taken now: a bucketed step shows the optimizer one bucket's part of its groups at a time
    held = [p for g in opt.param_groups for p in g["params"] if getattr(p, "_mixprec_role", ("",))[0] == "proxy"]

    def pre_step(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # rebuilt values (not a bucket's zero-byte placeholder: an expanded scalar)
        values = [p.data for p in held if p.untyped_storage().data_ptr() not in persistent
                  and p.untyped_storage().nbytes() >= p.numel() * p.element_size()]
        step_time.append(storage_bytes([*values, *(p.grad for p in held if p.grad is not None)]))

    hooks.append(opt.register_step_pre_hook(pre_step))
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    if live is not None:
        live.reset_peak()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with mp.autocast():
                out = task.run_forward(model, inputs)
            loss = task.loss_fn(out, targets)
        del out  # only what autograd saved should outlive the forward
        mp.step(loss, opt)
        peak = live.peak if live is not None else None
        if cuda:
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
    finally:
        for h in hooks:
            h.remove()
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    copies = sum(b for b, is_copy in saved.values() if is_copy)
    measured = {
        "weights": storage_bytes(params),
        "masters": storage_bytes(masters),
        "optimizer state": storage_bytes(state),
        "gradients": sum(grads.values()),
        "autocast weight copies": copies,
        "activations": sum(b for b, _ in saved.values()) - copies,
        "step-time fp32": max(step_time, default=0),
        "fp32 grad accumulators": 0,  # one step of accumulate=1
    }
    return Measured(measured, counts, peak, str(dev))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def measure_parallel_step(task: Task, recipe: str | Recipe, parallel: Any, optimizer: str = "adamw",
                          device: str | torch.device | None = "cpu", seed: int = 0, warmup: int = 1) -> Measured:
    """What one rank holds in a steady step under ``parallel`` ("ddp", "fsdp" or a config): the
    persistent components (weights, masters, optimizer state: this rank's shards under FSDP2),
    the gradients as backward leaves them, and the step-time fp32 at the optimizer step. Run it
    on every rank, after ``init_process_group``; every rank trains on ``task.get_batch``.
    Activations are not measured here (``measure_step`` measures them on one process; they do
    not depend on the parallel mode)."""
    dev = as_device(device)
    rec = resolve_recipe(recipe, dev)
    torch.manual_seed(seed)
    model = task.build_model().to(dev)
    counts = count_params(model, rec)
    mp = MixedPrecision(rec, dev)
    model = mp.prepare(model, parallel=parallel)
    opt = make_optimizer(optimizer, mp.parameters(model), dev)

    def forward_backward(step: int) -> None:
        inputs, targets = to_device(task.get_batch(step), dev)
        with mp.autocast():
            out = task.run_forward(model, inputs)
        mp.scaler.scale(task.loss_fn(out, targets)).backward()

    for i in range(warmup):
        inputs, targets = to_device(task.get_batch(1 + i), dev)
        with mp.autocast():
            out = task.run_forward(model, inputs)
        mp.step(task.loss_fn(out, targets), opt)
    held = [p for g in opt.param_groups for p in g["params"]]
    step_time: list[int] = []
    proxies = [p for p in held if getattr(p, "_mixprec_role", ("",))[0] == "proxy"]
    masters = [t for s in mp.masters.slots for t in mp.masters.extra_tensors(s)] if mp.masters else []
    persistent = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *masters]}

    def pre_step(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        values = [p.data for p in proxies if p.untyped_storage().data_ptr() not in persistent
                  and p.untyped_storage().nbytes() >= p.numel() * p.element_size()]
        step_time.append(storage_bytes([*values, *(p.grad for p in proxies if p.grad is not None)]))

    hook = opt.register_step_pre_hook(pre_step)
    try:
        forward_backward(0)
        grads = storage_bytes([_local(p.grad) for p in model.parameters() if p.grad is not None])
        # (a name of its own for the step's parts: mixprec lint takes whatever calls unscale_() for a GradScaler)
        parts = mp
        parts.after_backward(opt)
        parts.unscale_(opt)
        parts.optimizer_step(opt)
    finally:
        hook.remove()
    state = [_local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    measured = {
        "weights": storage_bytes([_local(p) for p in model.parameters()]),
        "masters": storage_bytes(masters),
        "optimizer state": storage_bytes(state),
        "gradients": grads,
        "autocast weight copies": 0,  # not measured here
        "activations": 0,
        "step-time fp32": max(step_time, default=0),
        "fp32 grad accumulators": 0,
    }
    return Measured(measured, counts, None, str(dev))
