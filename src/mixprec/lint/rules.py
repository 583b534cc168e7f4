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
    severity: str = "error"  # "error": a trap; "info": worth knowing, not a failure (exit status 0)


RULES: dict[str, Rule] = {
    rule.code: rule
    for rule in (
        Rule(
            "MP000",
            "syntax-error",
            "The file could not be parsed by the Python running mixprec (or, exit status 3, the "
            "linter failed on it), so none of its training loop was checked.",
            "Make the file valid Python for this interpreter (run it through `python -m py_compile`), "
            "or lint it with the newer Python it is written for; a file the linter failed on is a "
            "linter bug worth reporting.",
        ),
        Rule(
            "MP101",
            "clip-before-unscale",
            "Gradients are still multiplied by the loss scale (65536 at the start), so the clip "
            "compares a norm 65536 times too large with max_norm: it fires on every step and cuts "
            "the scaled gradients to norm max_norm, which scaler.step() then divides by the scale. "
            "The optimizer sees gradients of norm max_norm/scale: with SGD the real update shrinks "
            "to about 1/scale of the intended one (measured: update norm 1.5e-5 instead of 1.0 at "
            "scale 2^16, max_norm 1.0); Adam, which divides by the gradient's size, is hit less "
            "until its eps dominates the shrunk gradients (first update 0.51x the intended one at "
            "1M parameters, less in larger models). clip_grad_value_ likewise clamps the scaled "
            "values.",
            "Call scaler.unscale_(optimizer) after backward() and before clipping.",
        ),
        Rule(
            "MP102",
            "backward-in-autocast",
            "PyTorch's autocast documentation: autocast should wrap only the forward pass and the "
            "loss computation; backward passes under autocast are not recommended, and backward "
            "ops run in the dtype autocast chose for the corresponding forward ops. An enclosing "
            "autocast is not neutral either: in eager mode it autocasts the backward ops again, "
            "so the gradients of ops the forward ran in fp32 (an fp32 island under "
            "autocast(enabled=False)) are computed in 16 bits (measured on CPU with bf16: a "
            "matmul's weight gradient with relative error 4e-3 instead of 3e-7).",
            "Leave the autocast block after computing the loss; call backward() outside it.",
        ),
        Rule(
            "MP103",
            "step-bypasses-scaler",
            "optimizer.step() applies the gradients without the GradScaler's inf/NaN check. "
            "Without scaler.unscale_() they are still multiplied by the scale (65536 at the "
            "start), and a scaler.update() after it raises AssertionError ('No inf checks were "
            "recorded prior to update.'); after scaler.unscale_() they have the right size, but a "
            "step with inf/NaN gradients is applied instead of skipped, writing inf/NaN into the "
            "weights.",
            "Call scaler.step(optimizer) instead of optimizer.step().",
        ),
        Rule(
            "MP104",
            "scaler-update-missing",
            "Without scaler.update() once per step the scale never backs off after an overflow "
            "and never grows, and the next scaler.step() on the same optimizer raises "
            "RuntimeError ('step() has already been called since the last update().').",
            "Call scaler.update() once per iteration, after the last scaler.step().",
        ),
        Rule(
            "MP105",
            "scaler-update-twice",
            "update() sets the next scale from the inf checks of every optimizer stepped since "
            "the last update(). A second update() with no step between them raises AssertionError "
            "('No inf checks were recorded prior to update.'); an update() after each optimizer's "
            "step grows the scale twice as often (growth_interval counts updates), and after an "
            "overflow in the first optimizer the next one's gradients are unscaled with the "
            "already halved scale: measured, its update is 2x the true one.",
            "Call scaler.step() for each optimizer, then scaler.update() once.",
        ),
        Rule(
            "MP106",
            "half-model-no-master",
            "Casting the model to 16 bits and giving its parameters to the optimizer is low "
            "precision, not mixed precision: an update smaller than half a unit in the last place "
            "of a weight (2^-12 to 2^-11 of its size in fp16, 2^-9 to 2^-8 in bf16) rounds away, "
            "and the optimizer's state (Adam's moments) is created 16-bit too.",
            "Keep the model in fp32 and use torch.autocast (or a mixprec recipe); if memory "
            "demands 16-bit storage, keep fp32 master weights for the optimizer.",
        ),
        Rule(
            "MP107",
            "scaler-with-bf16",
            "bf16 has fp32's exponent range, so its gradients underflow no more than fp32's do "
            "and need no loss scaling; an enabled GradScaler only adds an inf/NaN check and a "
            "device-to-host sync to every scaler.step().",
            "Drop the GradScaler for bf16, or construct it with enabled=False.",
        ),
        Rule(
            "MP108",
            "fp16-without-scaler",
            "fp16 cannot hold magnitudes below 2^-24 (6.0e-8): smaller gradient values round to "
            "zero (2.9e-8 and 1e-8 become 0) and those below 6.1e-5 keep fewer significant bits. "
            "Without loss scaling the small activation gradients of a backward() in fp16 are "
            "lost, and the parameters that depend on them learn less or stop learning.",
            "Use a GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()) "
            "or switch autocast to dtype=torch.bfloat16.",
        ),
        Rule(
            "MP109",
            "step-in-autocast",
            "autocast caches the 16-bit copies of the weights for the whole region: an optimizer "
            "step inside it updates the fp32 weights, but a forward later in the same region (the "
            "next iteration of a loop that one autocast wraps) still uses the stale cached copies "
            "(measured: the forward after the step returns exactly what it returned before it). "
            "Ops the update itself uses that autocast lists (matmuls) also run in 16 bits there.",
            "Move the optimizer step (and scaler.step) after the autocast block.",
        ),
        Rule(
            "MP110",
            "sensitive-loss-in-autocast",
            "A custom loss defined in this file runs under autocast with arithmetic that stays "
            "16-bit there: sqrt, std/var, a division by an epsilon-guarded value, an epsilon "
            "fp16 cannot hold (an eps of 1e-8 is 0 in fp16), and, under CPU autocast, log/exp/a "
            "non-constant power too: on CPU log and exp are not upcast at all (CPU autocast's fp32 "
            "list has none of them), while CUDA autocast runs log, exp, pow and the norms in fp32.",
            "Upcast the loss's inputs: loss_fn(logits.float(), target), or .float() inside the "
            "loss. torch.autocast(device, enabled=False) around it helps only with the inputs "
            "upcast too: disabling autocast does not convert tensors that are already 16-bit.",
        ),
        Rule(
            "MP111",
            "checkpoint-without-scaler",
            "The checkpoint saves model and optimizer state but not the GradScaler's: a resumed "
            "run starts again at the initial scale (65536) with its growth counter at zero. A run "
            "that had backed off to 2^10 skips 6 steps on overflows before it trains again "
            "(measured), so the resumed run does not continue the one it resumed.",
            "Save scaler.state_dict() in the checkpoint and load it with scaler.load_state_dict().",
        ),
        Rule(
            "MP112",
            "scaler-step-unscaled-backward",
            "scaler.step() divides the gradients by the scale, but this backward() ran on an "
            "unscaled loss, so the gradients the optimizer sees are the scale (65536 at the "
            "start) times too small: with SGD the update is 1/65536 of the intended one (measured "
            "1.5e-5x), with Adam its eps then dominates (measured 0.52x at 1000 parameters). If "
            "the scaler never scaled anything, scaler.step() raises AssertionError instead.",
            "Call scaler.scale(loss).backward() instead of loss.backward().",
        ),
        Rule(
            "MP113",
            "optimizer-stepped-twice",
            "scaler.step(optimizer) already calls optimizer.step() unless it skips the step; a "
            "second optimizer.step() in the same pass applies the same gradients again (two "
            "updates per batch, and the momentum advanced twice), and on a step the scaler "
            "skipped for inf/NaN gradients it applies them anyway, writing inf/NaN into the "
            "weights.",
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
            "MP116",
            "update-per-micro-batch",
            "GradScaler.update() sets the next scale from the inf checks that scaler.step() (or "
            "unscale_()) recorded since the last update(). Under gradient accumulation, an update() "
            "on every micro-batch while step() runs only at the accumulation boundary finds no inf "
            "check on the micro-batches in between and raises AssertionError ('No inf checks were "
            "recorded prior to update.'); with several optimizers stepping at different boundaries "
            "it grows and backs off the scale on the wrong steps.",
            "Call scaler.update() in the same `if` as scaler.step(), once per optimizer step, after "
            "the last scaler.step() of that step.",
        ),
        Rule(
            "MP117",
            "autocast-disabled-without-upcast",
            "torch.autocast(enabled=False) stops autocast from casting the ops inside it; it does "
            "not convert tensors that are already 16-bit. Values computed under the enclosing "
            "autocast (a forward's output) stay fp16/bf16 there, and the ops meant to run in fp32 "
            "(a loss, exp, log, a norm) run in 16 bits instead: an fp16 exp overflows above 11.1, "
            "and a loss that autocast would have run in fp32 (l1_loss, mse_loss: on its fp32 list) "
            "now runs in fp16.",
            "Upcast the inputs inside the region: with torch.autocast(device, enabled=False): "
            "loss = criterion(out.float(), target.float()).",
        ),
        Rule(
            "MP118",
            "clip-per-micro-batch",
            "Under gradient accumulation the gradients of one optimizer step are summed over the "
            "micro-batches; clipping inside the micro-batch loop clips each partial sum, so the "
            "step sees the sum of clipped partial sums instead of the clipped total: the update's "
            "size depends on how many micro-batches there are and on where in the sum a large "
            "gradient came, and with a GradScaler the partial sums are still scaled.",
            "Clip once per optimizer step, at the accumulation boundary, after the last "
            "backward() (and after scaler.unscale_(optimizer)) and before the step.",
        ),
        Rule(
            "MP119",
            "per-parameter-sync",
            "A Python `if` (or .item(), bool(), assert) on a tensor waits for the device and copies "
            "the value to the host. Checking torch.isfinite(p.grad).all() parameter by parameter "
            "does that once per tensor, every step: hundreds of host-device round trips that stall "
            "the GPU's queue (a GradScaler, or mp.step, checks every gradient without a sync).",
            "Check all gradients at once, with one sync: "
            "torch.stack([torch.isfinite(p.grad).all() for p in params]).all(), or "
            "torch._foreach_norm(grads); or leave the inf check to the GradScaler / mp.step.",
        ),
        Rule(
            "MP120",
            "scheduler-after-skipped-step",
            "When its gradients hold inf/NaN, scaler.step(optimizer) skips the optimizer's step, but "
            "the learning-rate scheduler stepped right after it advances anyway: each skipped step "
            "moves the schedule one step ahead of the weights (a few steps at the start of fp16 "
            "training, while the scale calibrates), and torch warns that lr_scheduler.step() ran "
            "before optimizer.step(). Reported once per file.",
            "Step the scheduler only when the optimizer stepped: mp.step(loss, optimizer, "
            "scheduler=scheduler) does it, or compare the scale around update(): "
            "before = scaler.get_scale(); scaler.update(); "
            "if scaler.get_scale() >= before: scheduler.step().",
            severity="info",
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
