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

What a proxy is between steps is the strategy's choice: the fp32 master itself (``fp32``), or a
zero-byte placeholder of the right shape (the compact strategies: their fp32 value exists only
during the step, rebuilt from what they keep).

A skipped step (inf/NaN gradients) leaves proxies as they were, and writing back an unchanged
value changes nothing in any strategy (Kahan is a no-op on zero updates): skipped steps leave
masters, model and optimizer state bitwise unchanged without a host sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.masters.guard import built_over_16bit, install_guard
from mixprec.masters.rounding import join_fp32, kahan_add_, split_fp32, stochastic_round_bf16
from mixprec.masters.rules import ParamRule, fp32_param_names


@dataclasses.dataclass
class _Slot:
    name: str
    param: nn.Parameter  # the model's parameter, stored in 16 bits
    proxy: nn.Parameter  # what the optimizer holds: always fp32
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # compensation, remainder


class MasterWeights:
    """Base class: bookkeeping and the step protocol; subclasses say how fp32 values are kept.

    Args:
        storage_dtype: the 16-bit dtype parameters are stored in.
        fp32_params: the rule for parameters that stay fp32 (see ``mixprec.masters.rules``).
    """

    kind = "?"
    #: persistent bytes per 16-bit parameter on top of its own 2 (what the planner uses).
    extra_bytes = 0
    #: fp32 bytes per 16-bit parameter that exist only during the optimizer step (value, grad).
    step_bytes = 8
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
        self.stepping = False
        self._placeholders: dict[torch.device, torch.Tensor] = {}

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
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in keep or not p.is_floating_point():
                    continue
                value_32 = p.detach().clone()
                proxy = nn.Parameter(self._placeholder(p), requires_grad=p.requires_grad)
                slot = _Slot(name, p, proxy)
                p.data = p.data.to(self.storage_dtype)
                self._init_slot(slot, value_32)
                p._mixprec_role = ("stored", self, name)  # type: ignore[attr-defined]
                proxy._mixprec_role = ("proxy", self, name)  # type: ignore[attr-defined]
                self.slots.append(slot)
                self._by_param[id(p)] = slot
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

    def after_backward(self, optimizers: Sequence[torch.optim.Optimizer], boundary: bool) -> None:
        """Fold 16-bit gradients into fp32 proxy gradients; at a boundary, materialise the proxies."""
        if boundary:
            self.check_optimizers(optimizers)
        with torch.no_grad():
            for s in self.slots:
                g = s.param.grad
                if g is None:
                    continue
                if s.proxy.grad is None:
                    s.proxy.grad = g.to(torch.float32)
                else:
                    s.proxy.grad.add_(g)  # accumulation across micro-steps happens in fp32
                s.param.grad = None
            if boundary:
                for s in self.slots:
                    s.proxy.data = self._materialize(s)
                self.stepping = True

    def after_step(self) -> None:
        """Write the stepped fp32 values back into 16-bit storage and release step-only memory."""
        with torch.no_grad():
            for s in self.slots:
                self._write_back(s, s.proxy.data)
                s.proxy.grad = None
                self._release(s)
        self.stepping = False

    # ------------------------------------------------------------------ per strategy

    def _init_slot(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(value_32)

    def _materialize(self, slot: _Slot) -> torch.Tensor:
        return slot.param.to(torch.float32)

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        raise NotImplementedError

    def _release(self, slot: _Slot) -> None:
        slot.proxy.data = self._placeholder(slot.param)

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
        return {s.name: self.master_value(s).clone() for s in self.slots}

    def nbytes(self) -> dict[str, int]:
        """Bytes held now: 16-bit parameters, fp32 parameters, and the strategy's own state."""
        model = self._check_model(None)
        stored = sum(s.param.numel() * s.param.element_size() for s in self.slots)
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
                self._release(s)

    def describe(self) -> str:
        n16 = sum(s.param.numel() for s in self.slots)
        return (
            f"{self.kind}: {self.description}; {len(self.slots)} tensors ({n16:,} params) stored in "
            f"{get_format(self.storage_dtype).name}, +{self.extra_bytes} B/param kept, "
            f"fp32: {', '.join(map(_rule_name, self.fp32_params)) or '-'} ({len(self.fp32_names)} tensors)"
        )


def _rule_name(rule: ParamRule) -> str:
    return rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))


class Fp32Masters(MasterWeights):
    """An fp32 master copy per 16-bit parameter (Apex O2, Megatron): the proxy *is* the master."""

    kind = "fp32"
    extra_bytes = 4
    step_bytes = 4  # the fp32 gradients
    description = "fp32 master copy, cast back to the model after each step"

    def _init_slot(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.proxy.data = value_32
        slot.param.copy_(value_32)

    def _materialize(self, slot: _Slot) -> torch.Tensor:
        return slot.proxy.data

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(value_32)  # round to nearest even, as torch casts

    def _release(self, slot: _Slot) -> None:
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


class KahanMasters(MasterWeights):
    """No master: each update is added to the 16-bit weight with a 16-bit Kahan compensation."""

    kind = "kahan"
    extra_bytes = 2
    description = "16-bit weights updated with a 16-bit Kahan compensation buffer"

    def _init_slot(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(value_32)
        slot.extra["comp"] = torch.zeros_like(slot.param)

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        kahan_add_(slot.param.data, slot.extra["comp"], value_32 - slot.param.to(torch.float32))

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

    def _init_slot(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(value_32)  # the starting point is rounded to nearest: no noise before training
        self._generator(slot.param.device)

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(stochastic_round_bf16(value_32, self._generator(slot.param.device)))

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
    description = "bf16 weights + int16 remainders = an exact fp32 master"

    def _init_slot(self, slot: _Slot, value_32: torch.Tensor) -> None:
        high, rem = split_fp32(value_32)
        slot.param.copy_(high)
        slot.extra["rem"] = rem

    def _materialize(self, slot: _Slot) -> torch.Tensor:
        return join_fp32(slot.param.data, slot.extra["rem"])

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        high, rem = split_fp32(value_32)
        slot.param.copy_(high)
        slot.extra["rem"].copy_(rem)

    def master_value(self, slot: _Slot) -> torch.Tensor:
        return join_fp32(slot.param.data, slot.extra["rem"])

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"master": self.master_value(slot)}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        self._write_back(slot, state["master"].to(device=slot.param.device, dtype=torch.float32))


class NearestMasters(MasterWeights):
    """No master and no compensation: round to nearest after each step. UNSAFE, a baseline.

    The optimizer still steps in fp32 with fp32 state; only the weight is rounded. Any update
    smaller than half a 16-bit ulp of its weight (relative 2**-9 for bf16) is lost entirely.
    """

    kind = "nearest"
    extra_bytes = 0
    description = "16-bit weights rounded to nearest after each step, no master (small updates vanish)"

    def _write_back(self, slot: _Slot, value_32: torch.Tensor) -> None:
        slot.param.copy_(value_32)


STRATEGIES: dict[str, type[MasterWeights]] = {
    cls.kind: cls for cls in (Fp32Masters, KahanMasters, StochasticRoundingMasters, RemainderMasters, NearestMasters)
}


def make_masters(kind: str, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule]) -> MasterWeights:
    """The strategy a recipe names (``Recipe.master``)."""
    cls = STRATEGIES.get(kind)
    if cls is None:
        raise ValueError(f"unknown master-weight strategy {kind!r}; expected one of {sorted(STRATEGIES)}")
    return cls(storage_dtype, fp32_params)
