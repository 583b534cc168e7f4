"""Why an op produced a NaN or an infinity, read from the op's name and the ranges of its inputs.

``explain(event)`` returns a ``Cause``: a short code (``log-of-zero``, ``division-by-zero``,
``sqrt-of-negative``, ``matmul-overflow``...), a sentence of evidence, and the fix. The guard
prints it and ``doctor`` reports it; tests check the codes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mixprec.formats import get_format

if TYPE_CHECKING:
    from mixprec.diagnostics._stats import TensorRange

# ``event`` below is a ``NonFiniteEvent`` (diagnostics.events), read by its attributes only: op,
# kind, phase, module, module_type, dtype, inputs, origin, scaled, scale.

LOG_OPS = frozenset({"log", "log_", "log2", "log10", "log1p", "xlogy", "special_xlogy", "log_softmax"})
SQRT_OPS = frozenset({"sqrt", "sqrt_"})
RSQRT_OPS = frozenset({"rsqrt", "rsqrt_"})
DIV_OPS = frozenset({"div", "div_", "true_divide", "divide", "floor_divide", "fmod", "remainder"})
RECIPROCAL_OPS = frozenset({"reciprocal", "reciprocal_", "rdiv"})
MATMUL_OPS = frozenset({"matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "addbmm", "einsum", "conv1d",
                        "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "scaled_dot_product_attention",
                        "tensordot", "dot", "vdot", "inner", "outer", "bilinear"})
EXP_OPS = frozenset({"exp", "exp_", "exp2", "expm1", "pow", "pow_", "square", "cosh", "sinh"})
REDUCE_OPS = frozenset({"sum", "mean", "var", "std", "norm", "cumsum", "prod", "var_mean", "std_mean", "linalg_norm",
                        "vector_norm"})
CAST_OPS = frozenset({"to", "half", "float16", "bfloat16", "type", "float", "_to_copy", "copy_"})


@dataclasses.dataclass(frozen=True)
class Cause:
    code: str
    text: str
    fix: str


def _fmt(dtype) -> str:
    try:
        return get_format(dtype).name
    except ValueError:
        return str(dtype).removeprefix("torch.")


def _touches_zero(r: "TensorRange | None") -> bool:
    return r is not None and not r.nan and r.min <= 0.0 <= r.max


def _island_fix(event: Any) -> str:
    if event.module is None:
        return "run it in fp32: cast its inputs with .float() outside mp.autocast()"
    return (f"run it in fp32: MixedPrecision(..., fp32_modules=[{event.module_type!r}]) or "
            f"mixprec.keep_fp32(model, [{event.module or event.module_type!r}])")


def explain(event: Any) -> Cause:
    """The likely cause of ``event`` and its fix."""
    op = (event.op or "").lower()
    ins = event.inputs
    first = ins[0] if ins else None
    fmt = _fmt(event.dtype)
    sixteen = fmt in ("f16", "bf16")
    if event.origin == "input":
        if event.phase == "backward":
            return Cause("nonfinite-gradient-from-loss",
                         "the gradient reaching the model's output was already non-finite: the loss (or code "
                         "between the model and the loss) produced it",
                         "guard the loss computation too (compute it inside the nan_guard block), and compute it in fp32")
        held = getattr(event, "held_by", ())
        if held:
            return Cause("nonfinite-parameter",
                         f"{event.where_text} received {event.kind.upper()} that the model itself holds: "
                         f"{', '.join(held)}",
                         "find what wrote it: an earlier step that was not skipped (guard the training steps, or "
                         "use skip_nonfinite=True), a checkpoint that holds it, or an init that divides by zero")
        return Cause("nonfinite-input", f"{event.where_text} received inputs that already held {event.kind.upper()}",
                     "check the batch (and anything computed before the guarded forward)")
    if event.origin == "constant":
        return Cause("nan-constant", f"{event.op or 'the op'} was given NaN as a number (float('nan'), math.nan, "
                     "or a value computed as NaN in Python) and so made NaN from finite tensors",
                     "find the NaN number in the code at the location above (a 0/0 or inf - inf done in Python)")
    if event.phase == "backward":
        follows = getattr(event, "follows", None)
        if follows:
            return Cause("follows-forward-fault",
                         f"the forward of this step already went non-finite ({follows}): its backward carries that "
                         "value (a backward reads what its forward saved), so this is a consequence, not a second fault",
                         "fix the forward fault named above; this one goes with it")
        if event.scaled:
            return Cause("scaled-gradient-overflow",
                         f"gradients times the loss scale ({event.scale:g}) overflowed {fmt}",
                         "nothing: the loss scaler skips this step and lowers the scale. Repeated overflows "
                         "without recovery are a fault: see the scale monitor")
        node = (event.node or "").lower()
        if node.startswith("log") or op in LOG_OPS:
            return Cause("log-of-zero", "the backward of log divides by its input, which held 0",
                         "keep the argument of log away from 0 (log(x + eps), log_softmax, F.cross_entropy)")
        if node.startswith(("sqrt", "rsqrt", "pow")):
            return Cause("sqrt-of-zero", "the backward of sqrt divides by sqrt(x), which was 0",
                         "add eps inside the sqrt: sqrt(x + eps)")
        if node.startswith("div"):
            return Cause("division-by-zero", "the backward of a division divides by the denominator, which held 0",
                         "keep the denominator away from 0")
        if sixteen:
            return Cause("gradient-overflow", f"a gradient passed the {fmt} maximum ({get_format(event.dtype).max:g})",
                         "use dynamic loss scaling (fp16-mixed) or bf16")
        return Cause("unknown", "a gradient became non-finite from finite ones", "inspect the op named above")
    # forward, produced here
    if op in LOG_OPS and first is not None:
        if event.kind == "nan" and first.min < 0:
            return Cause("log-of-negative", f"log of a negative number: its input ranged over [{first.min:.3g}, {first.max:.3g}]",
                         "keep the argument of log positive")
        if first.min <= 0:
            extra = f" ({fmt} flushed small positive values to 0)" if sixteen else ""
            return Cause("log-of-zero", f"log(0) = -inf: its input reached {first.min:.3g}{extra}",
                         "use log_softmax / F.cross_entropy instead of log(softmax(x)), or clamp: log(x.clamp_min(tiny)); "
                         "or " + _island_fix(event))
    if op in RSQRT_OPS and _touches_zero(first):
        return Cause("division-by-zero", f"rsqrt(0) = inf: its input reached {first.min:.3g}",  # type: ignore[union-attr]
                     "add eps before the rsqrt, in fp32 if the value is a variance")
    if op in SQRT_OPS | RSQRT_OPS | {"pow", "pow_"} and event.kind == "nan" and first is not None and first.min < 0:
        return Cause("sqrt-of-negative", f"sqrt of a negative number: its input ranged over [{first.min:.3g}, {first.max:.3g}]",
                     "clamp the argument (x.clamp_min(0)) or fix what makes it negative")
    denominator = ins[1] if op in DIV_OPS and len(ins) > 1 else first if op in RECIPROCAL_OPS else None
    if (op in DIV_OPS or op in RECIPROCAL_OPS) and _touches_zero(denominator):
        extra = f" ({fmt} flushed it to 0)" if sixteen and denominator.min == 0 == denominator.max else ""  # type: ignore[union-attr]
        return Cause("division-by-zero",
                     f"division by zero: the denominator ranged over [{denominator.min:.3g}, {denominator.max:.3g}]{extra}",  # type: ignore[union-attr]
                     "add eps to the denominator; if it is a variance or norm, compute it in fp32")
    if event.kind == "inf" and sixteen:
        limit = get_format(event.dtype).max
        if op in MATMUL_OPS:
            return Cause("matmul-overflow", f"a {op} result passed the {fmt} maximum ({limit:g}); inputs were finite",
                         f"bf16 has fp32's range; or scale the operands down before the {op} "
                         f"(q * hs**-0.5 before q @ k.T), or {_island_fix(event)}")
        if op in EXP_OPS:
            return Cause("exp-overflow", f"{op} passed the {fmt} maximum ({limit:g})",
                         "subtract the max before exp (use softmax/logsumexp), or " + _island_fix(event))
        if op in REDUCE_OPS:
            return Cause("reduction-overflow", f"a {op} in {fmt} passed {limit:g}",
                         "accumulate in fp32: x.float().sum(), or " + _island_fix(event))
        if op in CAST_OPS:
            return Cause("cast-overflow", f"a value past {limit:g} was cast to {fmt}", _island_fix(event))
        return Cause("overflow", f"{op or 'the module'} passed the {fmt} maximum ({limit:g})", _island_fix(event))
    if event.kind == "nan" and sixteen and (op in MATMUL_OPS or op in REDUCE_OPS) and not any(r.nan or r.inf for r in ins):
        # finite inputs, a NaN out: partial sums overflowed to +inf and -inf, and adding them made NaN
        limit = get_format(event.dtype).max
        return Cause("matmul-overflow" if op in MATMUL_OPS else "reduction-overflow",
                     f"a {op} in {fmt} overflowed: its products or partial sums passed the {fmt} maximum ({limit:g}) "
                     "with both signs, and inf - inf made NaN; inputs were finite",
                     f"bf16 has fp32's range; or scale the operands down before the {op}, or {_island_fix(event)}")
    if event.kind == "nan" and any(r.inf for r in ins):
        return Cause("inf-arithmetic", "NaN from infinite inputs (inf - inf, 0 * inf, softmax of an all -inf row)",
                     "find where the infinity came from (an allowed infinity reaching this op?)")
    return Cause("unknown", f"{op or 'the module'} produced {event.kind.upper()} from finite inputs",
                 "inspect the op at the location above")
