"""The guard on ``optimizer.step()``: 16-bit stored weights train only through ``mp.step``.

A global optimizer pre-step hook, installed when a 16-bit storage recipe first prepares a model.
Parameters carry ``_mixprec_role = (kind, strategy, name)``: ``"stored"`` on the model's 16-bit
parameters, ``"proxy"`` on their fp32 masters, ``"frozen"`` on parameters frozen at prepare
(16-bit, no master; the hook refuses to step one that has a gradient). The hook refuses an optimizer holding a stored
parameter (it would train 16-bit weights without masters), and an optimizer holding masters
stepped outside ``mp.step`` (their gradients and values exist only inside it).

Also the checks of a master-weight state before it is loaded (``check_masters_state``,
``check_slot_state``): a state that does not fit is refused, naming the parameter, before anything is
written, so ``MixedPrecision.load_state_dict`` can check every part of a checkpoint before it applies any.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.formats import get_format


def added_without_master(p: torch.Tensor, opt: torch.optim.Optimizer) -> str:
    shape = "x".join(map(str, p.shape)) or "scalar"
    return (
        f"the optimizer ({type(opt).__name__}) holds a {get_format(p.dtype).name} parameter of shape {shape} that "
        "mp.prepare did not store (added to the model or to the optimizer after prepare): it has no fp32 master, "
        "so stepping it would update the 16-bit weight directly and lose small updates. Add every module before "
        "mp.prepare(model) and build the optimizer over mp.parameters(model), or keep the new parameters in fp32"
    )


def built_over_16bit(name: str, dtype: torch.dtype) -> str:
    return (
        f"the optimizer holds parameter {name!r}, which this recipe stores in {get_format(dtype).name}: "
        "stepping it would update the 16-bit weight directly and lose small updates (no master "
        "weights). Build the optimizer over mp.parameters(model) (the fp32 masters), e.g. "
        "torch.optim.AdamW(mp.parameters(model), lr=...)."
    )


def unfrozen_after_prepare(name: str, dtype: torch.dtype) -> str:
    return (
        f"parameter {name!r} was frozen (requires_grad=False) when mp.prepare stored it in "
        f"{get_format(dtype).name}, so it has no fp32 master, yet it has a gradient now: training it "
        "would update the 16-bit weight directly and lose small updates. Set requires_grad before "
        "mp.prepare(model) (prepare gives every trainable parameter a master), or keep it frozen."
    )


def _guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer pre-step hook: 16-bit stored weights train only through ``mp.step``.

    Runs for every optimizer in the process once a 16-bit storage recipe has prepared a model; what
    it finds is cached on the optimizer until its parameter count changes, so a step costs a sum.
    """
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = optimizer.__dict__.get("_mixprec_guard")
    if cached is None or cached[0] != count:
        roles, frozen = [], []
        for g in optimizer.param_groups:
            for p in g["params"]:
                r = getattr(p, "_mixprec_role", None)
                if r is not None:
                    (frozen.append((p, r)) if r[0] == "frozen" else roles.append(r))
        role = next((r for r in roles if r[0] == "stored"), roles[0] if roles else None)
        cached = optimizer.__dict__["_mixprec_guard"] = (count, role, frozen)
    role, frozen = cached[1], cached[2]
    for p, (_, owner, name) in frozen:  # frozen 16-bit weights (no master) must stay frozen
        if not owner.stepping and p.grad is not None:  # inside mp.step the strategy checked already
            raise RuntimeError(unfrozen_after_prepare(name, owner.storage_dtype))
    if role is None:
        return
    kind, owner, name = role
    if kind == "stored":
        raise RuntimeError(built_over_16bit(name, owner.storage_dtype))
    if not owner.stepping:
        raise RuntimeError(
            f"optimizer.step() was called directly on the fp32 masters of a {owner.kind!r} master-weight "
            f"recipe (parameter {name!r}): mp.step(loss, optimizer) fills in their gradients and values "
            "and writes the result back into the 16-bit model. Call mp.step(loss, optimizer) instead of "
            "loss.backward(); optimizer.step()."
        )


_GUARD_HANDLE: Any = None


def install_guard() -> None:
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GUARD_HANDLE = register_optimizer_step_pre_hook(_guard)


def check_slot_state(name: str, saved: Any, mine: dict[str, torch.Tensor]) -> None:
    def shape(t: torch.Tensor) -> str:
        return "x".join(map(str, t.shape)) or "scalar"

    if not isinstance(saved, dict) or set(saved) != set(mine):
        got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"master-weight state for parameter {name!r} holds {got}, this strategy keeps "
                         f"{sorted(mine)}: it was saved by another version or edited; save it again with mp.state_dict()")
    for key, want in mine.items():
        got = saved[key]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            found = shape(got) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"master-weight state does not fit parameter {name!r}: checkpoint {found}, model "
                             f"{shape(want)} ({key}). The checkpoint was saved from a model of another shape: "
                             "build the model it was saved from, or start this one without it")
        if got.dtype != want.dtype:  # copy_ would convert it silently: an int truncates the masters, f64 rounds
            raise ValueError(f"master-weight state for parameter {name!r} ({key}) is {_dtype_name(got.dtype)}, "
                             f"this strategy keeps it in {_dtype_name(want.dtype)}: the checkpoint was edited or "
                             "converted (loading would convert the values silently); load the one mp.state_dict() saved")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_masters_state(masters: Any, state: Any) -> None:
    """Everything ``masters.load_state_dict(state)`` needs, checked without writing: the strategy and
    storage, the parameter names, each parameter's tensors and shapes."""
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict):
        got = sorted(map(str, state))[:6] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"master-weight state must be the dict mp.state_dict()['masters'] holds ({{'kind', 'storage', "
                         f"'params'}}), got {got}: the checkpoint is damaged or was edited; save it again with mp.state_dict()")
    storage = get_format(masters.storage_dtype).name
    if state.get("kind") != masters.kind or state.get("storage") != storage:
        raise ValueError(
            f"master-weight state was saved by strategy {state.get('kind')!r} storing "
            f"{state.get('storage')!r}; this recipe uses {masters.kind!r} storing {storage!r}"
        )
    saved, names = state["params"], {s.name for s in masters.slots}
    if set(saved) != names:
        missing, unexpected = sorted(names - set(saved)), sorted(set(saved) - names)
        raise ValueError(
            f"master-weight state does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (was it saved with another model or another fp32_params rule?)"
        )
    for s in masters.slots:
        check_slot_state(s.name, saved[s.name], masters._slot_state(s))
