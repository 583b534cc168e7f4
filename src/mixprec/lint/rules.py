"""The rule table: one place that says what each code means, why it matters and how to fix it.

Codes are stable: a code is never reused for a different trap. MP0xx is about the file itself,
MP1xx about the mixed-precision training step, MP2xx about deprecated APIs (the fixable ones).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    why: str
    fix: str
    fixable: bool = False


RULES: dict[str, Rule] = {
    rule.code: rule
    for rule in (
        Rule(
            "MP000",
            "syntax-error",
            "The file could not be parsed, so none of its training loop was checked.",
            "Make the file valid Python (run it through `python -m py_compile`).",
        ),
        Rule(
            "MP101",
            "clip-before-unscale",
            "Gradients are still multiplied by the loss scale (65536 at the start), so the clip "
            "compares them against a norm thousands of times too large and does nothing.",
            "Call scaler.unscale_(optimizer) after backward() and before clipping.",
        ),
        Rule(
            "MP102",
            "backward-in-autocast",
            "backward() takes its precision from the forward pass; running it inside autocast "
            "casts the backward ops again and is not supported by PyTorch.",
            "Leave the autocast block after computing the loss; call backward() outside it.",
        ),
        Rule(
            "MP103",
            "step-bypasses-scaler",
            "optimizer.step() applies gradients that are still scaled and never checks them for "
            "inf/NaN, so an overflowing step corrupts the weights instead of being skipped.",
            "Call scaler.step(optimizer) instead of optimizer.step().",
        ),
        Rule(
            "MP104",
            "scaler-update-missing",
            "Without scaler.update() once per step the scale never backs off after an overflow "
            "and never grows, and the next scaler.step() raises.",
            "Call scaler.update() once per iteration, after the last scaler.step().",
        ),
        Rule(
            "MP105",
            "scaler-update-twice",
            "update() adjusts the scale from the inf checks of every optimizer stepped since the "
            "last update; calling it more than once per step halves or grows the scale on a "
            "partial picture and resets the per-optimizer state too early.",
            "Call scaler.step() for each optimizer, then scaler.update() once.",
        ),
        Rule(
            "MP106",
            "half-model-no-master",
            "Casting the model to 16 bits and giving its parameters to the optimizer is low "
            "precision, not mixed precision: an update smaller than 2^-11 (fp16) or 2^-8 (bf16) "
            "of a weight rounds away, and the optimizer state is 16-bit too.",
            "Keep the model in fp32 and use torch.autocast (or a mixprec recipe); if memory "
            "demands 16-bit storage, keep fp32 master weights for the optimizer.",
        ),
        Rule(
            "MP107",
            "scaler-with-bf16",
            "bf16 has fp32's exponent range, so its gradients do not underflow; the GradScaler "
            "only adds an inf check (and a host sync) to every step.",
            "Drop the GradScaler for bf16, or construct it with enabled=False.",
        ),
        Rule(
            "MP108",
            "fp16-without-scaler",
            "fp16 gradients below 6e-8 flush to zero; without loss scaling small gradients are "
            "silently lost and those parameters stop learning.",
            "Use a GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()) "
            "or switch autocast to dtype=torch.bfloat16.",
        ),
        Rule(
            "MP109",
            "step-in-autocast",
            "The optimizer update should run in fp32 outside autocast; inside it, ops the update "
            "uses may be cast to 16 bits.",
            "Move the optimizer step (and scaler.step) after the autocast block.",
        ),
        Rule(
            "MP110",
            "sensitive-loss-in-autocast",
            "A custom loss defined in this file uses log/exp/sqrt/a non-constant power or a "
            "division by a computed value, and runs under autocast: the arithmetic between "
            "those ops stays 16-bit (an eps of 1e-8 is 0 in fp16), and on CPU log and exp are "
            "not upcast at all.",
            "Compute the loss outside autocast, or upcast inside it: logits.float(), or "
            "torch.autocast(device, enabled=False) around it.",
        ),
        Rule(
            "MP111",
            "checkpoint-without-scaler",
            "The checkpoint saves model and optimizer state but not the GradScaler's: a resumed "
            "run restarts at scale 65536 and overflows (skips steps) until it backs off again, "
            "so it does not continue the run it resumed.",
            "Save scaler.state_dict() in the checkpoint and load it with scaler.load_state_dict().",
        ),
        Rule(
            "MP112",
            "scaler-step-unscaled-backward",
            "scaler.step() divides the gradients by the scale, but this backward() ran on an "
            "unscaled loss: every update is the scale (65536 at the start) times too small.",
            "Call scaler.scale(loss).backward() instead of loss.backward().",
        ),
        Rule(
            "MP113",
            "optimizer-stepped-twice",
            "scaler.step(optimizer) already calls optimizer.step() (unless it skips the step); a "
            "second optimizer.step() in the same pass applies the same gradients again (two updates "
            "per batch), and on a step the scaler skipped for inf/NaN gradients it applies them "
            "anyway, writing inf/NaN into the weights.",
            "Step once: scaler.step(optimizer) when loss scaling is on, optimizer.step() in the "
            "other branch only (if amp: ... else: optimizer.step()).",
        ),
        Rule(
            "MP114",
            "unscale-per-micro-batch",
            "GradScaler.unscale_(optimizer) may run once per optimizer between two update() calls. "
            "Under gradient accumulation, calling it on every micro-batch while step() and update() "
            "run only every k micro-batches raises on the second micro-batch: RuntimeError "
            "'unscale_() has already been called on this optimizer since the last update()'.",
            "Unscale once per optimizer step, at the accumulation boundary: move "
            "scaler.unscale_(optimizer) (and the clip that needs it) into the same `if` as "
            "scaler.step(optimizer) and scaler.update(), after the last micro-batch's backward().",
        ),
        Rule(
            "MP115",
            "autocast-covers-only-loss",
            "autocast runs matmuls, convolutions and linear layers in 16 bits only inside its "
            "region, and that is where mixed precision saves time and memory. This region holds "
            "only the loss, which autocast never runs in 16 bits, while the forward that produced "
            "its inputs runs outside autocast, in fp32: the autocast changes nothing (unless the "
            "model enables autocast itself), and a GradScaler beside it scales fp32 gradients.",
            "Put the model's forward inside the autocast region with the loss: "
            "with torch.autocast(...): out = model(x); loss = criterion(out, y).",
        ),
        Rule(
            "MP201",
            "deprecated-amp-api",
            "torch.cuda.amp.* and torch.cpu.amp.* are deprecated (FutureWarning since torch 2.4) "
            "in favour of the device-generic torch.amp API.",
            'Use torch.autocast("cuda", ...), torch.amp.GradScaler("cuda", ...), '
            'torch.amp.custom_fwd(device_type="cuda") (mixprec lint --fix rewrites these).',
            fixable=True,
        ),
    )
}


class UnknownCodeError(ValueError):
    """A --select/--ignore entry that matches no rule."""


def expand_codes(patterns: list[str], origin: str) -> set[str]:
    """Turn codes or code prefixes (``MP1``, ``MP``) into the set of rule codes they name.

    A prefix that matches nothing is an error: a typo in --ignore would otherwise silently
    ignore nothing.
    """
    codes: set[str] = set()
    for raw in patterns:
        pattern = raw.strip().upper()
        if not pattern:
            continue
        matched = {code for code in RULES if code.startswith(pattern)}
        if not matched:
            raise UnknownCodeError(
                f"Unknown rule code {raw!r} in {origin}; expected a code or prefix of "
                f"{', '.join(RULES)}."
            )
        codes |= matched
    return codes


def enabled_codes(select: list[str] | None, ignore: list[str], origin: str = "options") -> set[str]:
    """The codes to report: ``select`` (all rules when None) minus ``ignore``."""
    chosen = set(RULES) if select is None else expand_codes(select, origin)
    return chosen - expand_codes(ignore, origin)
