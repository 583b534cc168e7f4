"""What goes into ``MixedPrecision`` and what comes out: the checks it makes at its doors
(optimizers, schedulers, the clip norm, the loss, the model, a state dict, ``nan_guard``), so a
mistake is one clear error before any work; ``StepStats``, what one ``step`` did; and
``describe``, what it will do."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, Union

import torch

from mixprec.formats import short_name
from mixprec.scaling.scaler import GradScaler
from mixprec.scaling.validate import check_state_dict


@dataclasses.dataclass
class StepStats:
    """What one call to ``MixedPrecision.step`` did. Tensors stay on the device: reading them
    (``float(stats.loss)``, ``stats.to_dict()``) is a host sync, and yours to choose.

    Attributes:
        loss: the unscaled fp32 loss (at an accumulation boundary: the mean over the window).
        grad_norm: total gradient norm before clipping (None unless clipping or ``track_grad_norm``).
        scale: the loss scale this step's backward used (1.0 without a scaler).
        skipped: 0-d bool; True when the optimizer step was attempted and skipped for inf/NaN
            gradients (parameters and optimizer state left as they were).
        stepped: whether an optimizer step was *attempted* at this call: False for an accumulation
            micro-step. So ``stepped=True, skipped=True`` is a step that was due and skipped; the
            update was applied when ``stepped and not skipped``.
        step: optimizer steps attempted so far, skipped ones included.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    scale: torch.Tensor
    skipped: torch.Tensor  # (given as the scaler's summed found_inf: made 0-d bool when first read)
    stepped: bool
    step: int

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name == "skipped" and value is not None and value.dtype != torch.bool:
            # the flag is formed when someone reads it, not on every step (one comparison saved)
            value = value > 0
            object.__setattr__(self, "skipped", value)
        return value

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (one sync per tensor field)."""
        return {
            "loss": float(self.loss),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "scale": float(self.scale),
            "skipped": bool(self.skipped),
            "stepped": self.stepped,
            "step": self.step,
        }


Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


class _Checked(list):
    """A list of optimizers ``_as_optimizers`` already checked: the step's parts take it as is."""


def _as_optimizers(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    if type(optimizers) is _Checked:  # the step handing its parts what it checked once
        return optimizers
    if optimizers is None or not isinstance(optimizers, (torch.optim.Optimizer, list, tuple)):
        raise TypeError(f"step() expects torch.optim.Optimizer instances (the optimizer to step, or a list of "
                        f"them), got {type(optimizers).__name__}")
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not opts:
        raise ValueError("step() needs at least one optimizer")
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"step() expects torch.optim.Optimizer instances, got {type(o).__name__}")
        if _needs_closure(type(o)):
            raise TypeError(
                f"{type(o).__name__}.step() needs a closure (it re-evaluates the loss several times per step, as "
                "torch.optim.LBFGS does): mp.step runs one backward of the loss it is given, so it cannot drive "
                "it. Use an optimizer that steps from the gradients (SGD, Adam, AdamW, ...), or train this "
                "one in fp32 without mp.step"
            )
    return _Checked(opts)


_CLOSURE: dict[type, bool] = {}  # optimizer class -> whether its step() requires a closure


def _needs_closure(cls: type) -> bool:
    needs = _CLOSURE.get(cls)
    if needs is None:
        import inspect

        try:
            closure = inspect.signature(cls.step).parameters.get("closure")
        except (TypeError, ValueError):  # (a step inspect cannot read: assume the usual closure=None)
            closure = None
        needs = _CLOSURE[cls] = closure is not None and closure.default is inspect.Parameter.empty
    return needs


class ModelsHeld:
    """Whether the optimizers given to ``step`` hold any parameter of a model this object prepared.

    An optimizer built over another module would "step" without training the model (bf16 and fp32
    recipes said nothing; fp16 raised torch's "No inf checks were recorded for this optimizer").
    Each set of optimizers is checked once; the prepared models are held weakly (one
    ``MixedPrecision`` may prepare several, e.g. a GAN's two). The 16-bit storage recipes' masters
    make the same check on their own (``MasterWeights.check_optimizers``).
    """

    def __init__(self) -> None:
        self._models: list[Any] = []  # weakrefs
        self._ok: set[tuple[int, ...]] = set()
        #: (parameter, dtype) of every floating parameter as ``prepare`` left it, the parameters held weakly
        #: (a wrapper that replaces them, FSDP2's sharding, frees the old ones); and (model class, name)
        self._stored: list[tuple[Any, torch.dtype]] = []
        self._names: list[tuple[str, str]] = []

    def add(self, model: torch.nn.Module) -> None:
        import weakref

        self._models.append(weakref.ref(model))
        for n, p in model.named_parameters():
            if p.is_floating_point():
                self._stored.append((weakref.ref(p), p.dtype))
                self._names.append((type(model).__name__, n))

    def check_storage(self, recipe: str) -> None:
        """Raise if a parameter of a prepared model is no longer in the dtype ``prepare`` left it in.

        ``model.half()``, ``model.to(torch.bfloat16)`` or ``model.float()`` after ``prepare`` cast the
        parameters in place, behind the recipe: a mixed recipe's optimizer would then step 16-bit
        weights without masters, a 16-bit storage recipe's masters would write back into (or rebuild
        from) weights of another dtype, and the step would say nothing. One dtype comparison per
        parameter, each step (about 0.2 us each)."""
        for i, (ref, dtype) in enumerate(self._stored):
            p = ref()
            if p is not None and p.dtype is not dtype:
                model, name = self._names[i]
                raise RuntimeError(
                    f"parameter {name!r} of the prepared {model} is stored in {str(p.dtype).replace('torch.', '')} now, but "
                    f"prepare() left it in {str(dtype).replace('torch.', '')} for recipe {recipe!r}: the model was cast after "
                    "prepare (model.half(), model.float(), model.to(dtype)), which changes its precision behind "
                    "the recipe (16-bit weights stepped without masters, or masters out of step with the weights). "
                    "Do not cast a prepared model: for fp32 weights use mp.fp32_state_dict(model); for another "
                    "precision build a MixedPrecision with that recipe and prepare a freshly built model"
                )

    def check(self, opts: Sequence[torch.optim.Optimizer]) -> None:
        key = tuple(id(o) for o in opts)
        if key in self._ok:
            return
        models = [m for m in (r() for r in self._models) if m is not None]
        ours = {id(p) for m in models for p in m.parameters()}
        if models and ours and not any(id(p) in ours for o in opts for g in o.param_groups for p in g["params"]):
            names = ", ".join(type(o).__name__ for o in opts)
            raise ValueError(
                f"the optimizer ({names}) holds none of the parameters of the prepared "
                f"{' or '.join(type(m).__name__ for m in models)}: it was built over another module (or over "
                "parameters replaced since), so the model would never train. Build it over mp.parameters(model) "
                "for the prepared model"
            )
        self._ok.add(key)


_MP_KEYS = {"recipe", "scaler", "steps", "masters", "fp8", "parallel"}


def _check_mp_state(state: Any) -> None:
    """Refuse what is not a ``MixedPrecision.state_dict()``, saying what it is and where it goes."""
    shape = "{'recipe': name, 'scaler': {...}, 'steps': n[, 'masters': {...}]}"
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects the dict mp.state_dict() returned ({shape}), got {type(state).__name__}")
    if {"scale", "growth_factor", "_growth_tracker"} <= set(state):
        raise ValueError("this is a loss scaler's state dict (torch.amp.GradScaler or mixprec.GradScaler), not a "
                         f"MixedPrecision one: load it with mp.scaler.load_state_dict(state). mp.state_dict() is {shape}")
    unknown = set(state) - _MP_KEYS
    if "recipe" not in state or "scaler" not in state or unknown:
        raise ValueError(f"not a MixedPrecision state dict (keys {sorted(state)[:6]}"
                         f"{', unknown: ' + str(sorted(unknown)[:6]) if unknown else ''}); mp.state_dict() is {shape}. "
                         "Save mp.state_dict() beside the model's and the optimizer's and load that")


def check_loadable(mp: Any, state: Any, strict: bool) -> int:
    """Every check ``MixedPrecision.load_state_dict`` makes, before it applies anything: the shape of the
    dict, the recipe, the scaler's, the masters' and the fp8 state, the step count (returned)."""
    _check_mp_state(state)
    if strict and state.get("recipe") != mp.recipe.name:
        raise ValueError(
            f"checkpoint was saved with recipe {state.get('recipe')!r}, this MixedPrecision uses "
            f"{mp.recipe.name!r}; pass strict=False to load the scaler state anyway"
        )
    steps = state.get("steps", 0)
    if isinstance(steps, torch.Tensor) and steps.numel() == 1 and not steps.is_floating_point():
        steps = steps.item()
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"the state's 'steps' must be an integer >= 0 (the optimizer steps taken), got "
                         f"{type(steps).__name__} {steps!r}"[:200] + ": the checkpoint is damaged or was edited; "
                         "load one saved with mp.state_dict()")
    scaler = state.get("scaler")
    if not isinstance(scaler, dict):
        raise TypeError(f"the state's 'scaler' must be the dict scaler.state_dict() returned, got {type(scaler).__name__}: "
                        "the checkpoint is damaged or was edited; load one saved with mp.state_dict()")
    if strict and (mp.masters is not None) != ("masters" in state):
        why = (f"the state lacks the master weights ('masters') recipe {mp.recipe.name!r} keeps: loading it would resume "
               "without the fp32 masters" if mp.masters is not None else
               f"the state holds master weights ('masters'), but recipe {mp.recipe.name!r} keeps none")
        raise ValueError(f"{why}; the checkpoint is damaged or was edited: load the dict mp.state_dict() saved, "
                         "or pass strict=False to load its other parts")
    if scaler and mp.scaler.is_enabled() and type(mp.scaler).load_state_dict is GradScaler.load_state_dict:
        check_state_dict(scaler)  # (a scaler with its own load_state_dict is put back if that raises)
    if mp.masters is not None and "masters" in state:
        mp.masters.check_state_dict(state["masters"])
    if mp.fp8 is not None or state.get("fp8"):
        from mixprec.fp8.state import check_fp8_state  # a capability: imported when the state has fp8 parts

        check_fp8_state(mp, state.get("fp8"), state.get("recipe"), steps=int(steps))
    return int(steps)


def _check_schedulers(scheduler: Any) -> None:
    for s in scheduler if isinstance(scheduler, (list, tuple)) else (scheduler,):
        if s is not None and not callable(getattr(s, "step", None)):
            raise TypeError(f"scheduler must be an lr scheduler (an object with .step(), e.g. "
                            f"torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max)) or a list of them; got "
                            f"{type(s).__name__} {s!r}"[:200])


def _check_max_grad_norm(max_grad_norm: float | None) -> None:
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_grad_norm!r}: a norm "
                         "of 0 would zero every update, a negative one would reverse it")


def clip_or_measure(params: Sequence[torch.Tensor], max_norm: float | None, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``params`` (``get_total_norm`` of their gradients when
    ``max_norm`` is None), the same kernels in the same order, so the same bits; without the
    per-call grouping torch does (a device/dtype grouping twice, a ``.to`` per gradient) when every
    gradient is one plain dense tensor of one device and dtype, the common case: on a small model
    that grouping was a tenth of the step (35 us of a few hundred with 4 gradients, measured).
    Anything else (several devices or dtypes, sparse or subclassed gradients) goes to torch's."""
    grads = [p.grad for p in params if p.grad is not None]
    device, dtype = (grads[0].device, grads[0].dtype) if grads else (None, None)
    plain = bool(grads) and all(type(g) is torch.Tensor and g.layout is torch.strided and g.device == device
                                and g.dtype is dtype for g in grads)
    if not plain:
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    with torch.no_grad():
        norm_type = float(norm_type)
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
        if max_norm is not None:
            # torch's rule: multiply by min(max_norm / (norm + 1e-6), 1), also when that is 1 (no sync)
            torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


def clip_dense_or_sparse(params: Sequence[torch.Tensor], max_grad_norm: float | None,
                         norm_type: float) -> torch.Tensor:
    """``clip_or_measure``, and where torch's clip raises for sparse gradients (it has no sparse norm,
    and raises before it scales anything), ``sparse_clip_or_measure``."""
    try:
        return clip_or_measure(params, max_grad_norm, norm_type)
    except NotImplementedError:
        sparse = sparse_clip_or_measure(params, max_grad_norm, norm_type)
        if sparse is None:
            raise
        return sparse


def sparse_clip_or_measure(params: Sequence[torch.Tensor], max_norm: float | None,
                           norm_type: float) -> torch.Tensor | None:
    """What ``MixedPrecision.step`` clips (measures) when some gradients are sparse
    (``nn.Embedding(sparse=True)`` with ``SparseAdam``), which torch's ``clip_grad_norm_`` (and so
    ``clip_or_measure``, torch's twin) cannot take: no sparse ``linalg_vector_norm``. A sparse
    gradient's norm is the norm of its coalesced values (the entries it leaves out are zeros),
    combined as torch combines norms; the clip multiplies every gradient by torch's coefficient.
    None when no gradient is sparse (the caller then runs ``clip_or_measure``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if all(g.layout is torch.strided for g in grads):
        return None
    with torch.no_grad():
        norm_type = float(norm_type)
        first = grads[0].device
        norms = [torch.linalg.vector_norm(g.coalesce().values() if g.layout is torch.sparse_coo else g.to_dense()
                                          if g.layout is not torch.strided else g, norm_type).to(first)
                 for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if max_norm is not None:
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
    return total


def check_loss(loss: Any) -> tuple[torch.Tensor, bool]:
    """The loss as fp32, and whether it arrived in 16 bits (its reduction then ran in 16 bits)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"step() expects the loss as a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"step() expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first (loss.mean())"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: was it computed under torch.no_grad(), or from "
            "detached tensors?"
        )
    if loss.dtype == torch.float32:
        return loss, False
    return loss.float(), loss.dtype in (torch.float16, torch.bfloat16)


def check_model_params(model: torch.nn.Module, device: torch.device, recipe: Any, stores_16bit: bool) -> None:
    """Refuse a model whose parameters are not where or what ``recipe`` expects at ``prepare``."""
    for name, p in model.named_parameters():
        if p.device.type != device.type:
            raise ValueError(
                f"parameter {name!r} is on {p.device}, but this MixedPrecision runs on {device}; "
                f"move the model first (model.to({str(device)!r}))"
            )
        if not p.is_floating_point():
            continue
        if stores_16bit and p.dtype != torch.float32:
            raise ValueError(
                f"parameter {name!r} is stored in {short_name(p.dtype)}; recipe {recipe.name!r} "
                "stores parameters in 16 bits itself, from an fp32 model (it needs the fp32 values for "
                "the masters). Call model.float() first (lossless from bf16/f16) and prepare again."
            )
        if not stores_16bit and p.dtype != recipe.policy.param_dtype:
            raise ValueError(
                f"parameter {name!r} is stored in {short_name(p.dtype)}, but recipe {recipe.name!r} "
                f"keeps parameters in {short_name(recipe.policy.param_dtype)}. model.half() is low "
                "precision, not mixed precision: small updates vanish without fp32 master weights. "
                "Call model.float() and let the recipe choose what runs in 16 bits."
            )


def describe(mp: Any) -> str:
    """``MixedPrecision.describe()``: recipe, policy, scaler, masters, fp32 families (with what
    prepare matched), device, fp8 layers, parallel mode."""
    r = mp.recipe
    scaler = type(mp.scaler).__name__ if mp.scaler.is_enabled() else "none"

    def family(rule: Any) -> str:  # norms (LayerNorm x4, LlamaRMSNorm x1) once prepare has matched it
        counts = mp._families.get(rule) if isinstance(rule, str) else None
        if counts is None:
            return str(getattr(rule, "__name__", rule))
        return f"{rule} ({', '.join(f'{c} x{n}' for c, n in counts.items()) or 'nothing matched'})"

    lines = [
        f"recipe   {r.name}  ({r.reason})",
        f"policy   {r.policy}  autocast={'on' if r.autocast else 'off'}",
        f"scaler   {scaler}",
        f"fp32     {', '.join(map(family, (*r.fp32_modules, *mp.fp32_modules))) or '-'}",
        f"device   {mp.device}",
    ]
    if mp.masters is not None:
        lines.insert(3, f"masters  {mp.masters.describe()}")
    if mp.fp8_spec is not None:  # which layers compute in fp8, and why the others do not
        from mixprec.fp8.state import describe_lines
        lines += describe_lines(mp.fp8_spec, mp.fp8)
    if mp._dist is not None:
        lines.append(f"parallel {mp._dist.describe()}")
    if getattr(mp, "attention", None) is not None:  # mixprec.attention (prepared), else the recipe's setting
        lines.append(mp.attention.describe())
    elif r.attention != "recipe":
        lines.append(f"attention: {r.attention} (routed at prepare)")
    return "\n".join(lines)


def _check_nan_guard(flag: Any) -> Any:
    """Refuse a bad ``nan_guard`` now rather than at ``prepare``."""
    if flag is None or isinstance(flag, (bool, dict)):
        return flag
    from mixprec.diagnostics.guard import _MODES  # (only here: the guard's module is not light)

    if not isinstance(flag, str):
        raise TypeError(f"nan_guard must be a bool, a mode ({', '.join(_MODES)}) or a dict of options; got {flag!r}")
    if flag not in _MODES:
        raise ValueError(f"nan_guard mode {flag!r} is not one of {', '.join(_MODES)} (or True/False, or a dict of options)")
    return flag
