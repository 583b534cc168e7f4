"""Run the fp32 model and its bf16 / fp16 casts on the same batches and compare the outputs.

    report = check_inference(model, batches, "both")
    print(report.summary())          # per dtype and output: SQNR, errors, top-1, the verdict, where it fails
    report.verdict                   # "agree" / "degraded" / "broken"

Both models run in eval mode under ``torch.no_grad()`` (dropout off: the comparison is of the
arithmetic, not of random masks); the model's mode is restored afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.inference.cast import NAMES, CastInfo, cast_for_inference, cast_info, inference_dtype
from mixprec.inference.locate import (
    Failure, ModuleError, NearOverflow, RangeRecorder, locate_degradation, locate_nonfinite, near_overflow,
)
from mixprec.inference.metrics import OutputStats, flatten_outputs, json_number
from mixprec.inference.verdict import Thresholds, judge, worst
from mixprec.policy import cast_floating
from mixprec.tasks import to_device

class InferenceCheckError(ValueError):
    """The check could not run (the fp32 model fails, no batches, no floating output); says what to do."""


def dtypes_of(spec: str | torch.dtype | Sequence[str | torch.dtype]) -> list[torch.dtype]:
    """``"both"`` -> [bf16, fp16]; ``"fp16"`` -> [fp16]; a sequence of names -> those, each once."""
    if isinstance(spec, str) and spec.strip().lower() == "both":
        return [torch.bfloat16, torch.float16]
    items = [spec] if isinstance(spec, (str, torch.dtype)) else list(spec)
    if not items:
        raise ValueError("no dtype to check; give bf16, fp16 or both")
    return list(dict.fromkeys(inference_dtype(s) for s in items))


def default_forward(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict of inputs (Hugging Face's ``input_ids=``...), else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


@dataclasses.dataclass
class DtypeResult:
    """One dtype's comparison with fp32.

    Attributes:
        dtype: ``"bf16"`` / ``"fp16"``; mode: ``"storage"`` / ``"autocast"``.
        cast: what the cast did (parameters kept fp32, islands, bytes).
        outputs: per output, over every batch; overall: all outputs pooled (None for one output).
        verdict, reasons: see ``mixprec.inference.verdict``.
        failure: the first module whose output went non-finite (None: none did, or not located).
        degradation: the first module whose output SQNR falls below the agree gate (when the
            verdict is not agree and nothing went non-finite).
        near_overflow: fp16 only: modules whose fp32 output peaks within 2 bits of 65504, or past it.
        loss: mean loss on the batches in fp32 and in this dtype (when a loss function was given).
        error: the low-precision forward raised (the verdict is then broken).
    """

    dtype: str
    mode: str
    cast: CastInfo | None = None
    outputs: list[OutputStats] = dataclasses.field(default_factory=list)
    overall: OutputStats | None = None
    verdict: str = "agree"
    reasons: list[str] = dataclasses.field(default_factory=list)
    failure: Failure | None = None
    degradation: ModuleError | None = None
    near_overflow: list[NearOverflow] = dataclasses.field(default_factory=list)
    loss: tuple[float, float] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype, "mode": self.mode, "verdict": self.verdict, "reasons": self.reasons,
            "cast": None if self.cast is None else self.cast.to_dict(),
            "outputs": [o.to_dict() for o in self.outputs],
            "overall": None if self.overall is None else self.overall.to_dict(),
            "failure": None if self.failure is None else self.failure.to_dict(),
            "degradation": None if self.degradation is None else self.degradation.to_dict(),
            "near_overflow": [n.to_dict() for n in self.near_overflow],
            "loss": None if self.loss is None else {"fp32": json_number(self.loss[0]),
                                                    self.dtype: json_number(self.loss[1])},
            "error": self.error,
            "same_as_fp32": self.same_as_fp32,
        }

    @property
    def same_as_fp32(self) -> bool:
        """Every compared output value equals fp32's bit for bit on every batch: no 16-bit rounding
        reached the outputs (the cast kept what this forward computes in fp32), so an ``agree`` here
        says nothing about 16-bit arithmetic."""
        return self.error is None and any(o.compared for o in self.outputs) and all(
            o.noise == 0.0 and o.nonfinite == 0 for o in self.outputs)

    def lines(self) -> list[str]:
        """What a reader needs below the table: the verdict with its reasons, and where it fails."""
        head = f"{self.dtype}: {self.verdict.upper()}"
        out = [head + (f": {'; '.join(self.reasons)}" if self.reasons else "")]
        if self.error:
            out.append(f"  the {self.dtype} forward raised {self.error}")
        if self.same_as_fp32:
            out.append(f"  every {self.dtype} output equals fp32's bit for bit: no {self.dtype} rounding reached them "
                       f"(what this forward computes was kept in fp32), so this verdict says nothing about {self.dtype}")
        if self.failure is not None:
            out.append("  " + self.failure.describe())
        if self.degradation is not None:
            out.append("  " + self.degradation.describe())
        for n in self.near_overflow:
            past = "past" if n.fp32_absmax > n.limit else f"{n.headroom_bits:.1f} bits below"
            out.append(f"  near overflow: {n.module} ({n.module_type}) reaches {n.fp32_absmax:.4g} in fp32, {past} "
                       f"{self.dtype}'s max {n.limit:.6g}")
        for o in self.outputs:
            if o.top1 is not None and o.top1 != o.top1_ties_aside:
                out.append(f"  {o.name}: raw top-1 {o.top1:.1%} ({o.top1_ties_aside - o.top1:.1%} of rows flipped "
                           "between near-tied classes)")
        if self.loss is not None:
            diff = self.loss[1] - self.loss[0]
            out.append(f"  loss: fp32 {self.loss[0]:.6g}, {self.dtype} {self.loss[1]:.6g}"
                       + (f" (difference {diff:+.3g})" if math.isfinite(diff) else ""))
        if self.cast is not None:
            out.append("  " + self.cast.describe())
        return out


@dataclasses.dataclass
class InferenceReport:
    """The check's result for every dtype asked for; ``verdict`` is the worst of them."""

    results: dict[str, DtypeResult]
    thresholds: Thresholds
    batches: int
    mode: str

    @property
    def verdict(self) -> str:
        return worst([r.verdict for r in self.results.values()])

    @property
    def exit_code(self) -> int:
        """0 when every dtype agrees with fp32, else 1 (the command's exit status)."""
        return 0 if self.verdict == "agree" else 1

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "mode": self.mode, "batches": self.batches,
                "thresholds": self.thresholds.to_dict(), "results": {k: r.to_dict() for k, r in self.results.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def summary(self) -> str:
        """Plain text: one line per dtype and output, then each dtype's verdict lines."""
        rows = []
        for r in self.results.values():
            for o in r.outputs + ([r.overall] if r.overall is not None else []):
                rows.append(f"{r.dtype:5} {o.name:14} " + "  ".join(f"{k} {v}" for k, v in stat_cells(o).items()))
        return "\n".join(rows + [line for r in self.results.values() for line in r.lines()]
                         + [f"thresholds: {self.thresholds.describe()}"])


def stat_cells(o: OutputStats) -> dict[str, str]:
    """An output's numbers as short strings (the command's table and ``summary``)."""
    def pct(x: float | None) -> str:  # rounded down: 99.96% is not "100.0%"
        return "-" if x is None else "100%" if x >= 1 else f"{math.floor(x * 1000) / 10:.1f}%"

    measured = o.compared > 0
    return {"SQNR dB": f"{o.sqnr:.1f}" if measured else "-", "max|err|": f"{o.max_abs_err:.2g}" if measured else "-",
            "rel err": f"{o.rel_err:.2g}" if measured else "-",
            "top-1": pct(o.top1_ties_aside), "raw top-1": pct(o.top1), f"top-{o.topk}": pct(o.topk_mean),
            "non-finite": str(o.nonfinite)}


def _class_outputs(flat: dict[str, torch.Tensor], classes: str | bool | Sequence[str]) -> set[str]:
    """Which outputs hold class scores in their last dim. ``"auto"``: the outputs named ``*logits*``
    (Hugging Face) if there are any, else every output of 2+ dims whose last dim is 2+."""
    eligible = {n for n, t in flat.items() if t.dim() >= 2 and t.shape[-1] >= 2}
    if classes is True:
        return eligible
    if classes is False or classes == "none":
        return set()
    if classes == "auto":
        named = {n for n in eligible if "logit" in n.lower()}
        return named or eligible
    wanted = [classes] if isinstance(classes, str) else list(classes)
    unknown = [w for w in wanted if w not in flat]
    if unknown:
        raise InferenceCheckError(f"classes names {unknown}, not outputs of the model; its outputs: {sorted(flat)}")
    return {w for w in wanted if w in eligible}


def _floating(out: Any) -> dict[str, torch.Tensor]:
    return {n: t for n, t in flatten_outputs(out) if t.is_floating_point()}


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def check_inference(
    model: nn.Module,
    batches: Iterable[Any],
    dtypes: str | torch.dtype | Sequence[str | torch.dtype] = "both",
    *,
    mode: str = "storage",
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    classes: str | bool | Sequence[str] = "auto",
    topk: int = 5,
    fp32_modules: Any = None,
    fp32_params: Any = None,
    thresholds: Thresholds | None = None,
    locate: bool = True,
) -> InferenceReport:
    """Compare ``model`` (fp32) with its ``cast_for_inference`` casts to each of ``dtypes`` on ``batches``.

    Args:
        model: the trained fp32 model; it is not changed (the casts are copies).
        batches: inputs, one per forward (moved to the model's device); ``(inputs, targets)`` pairs
            when ``loss_fn`` is given.
        dtypes: ``"bf16"``, ``"fp16"``, ``"both"`` or a sequence of names.
        mode, fp32_modules, fp32_params: how to cast (``cast_for_inference``).
        forward: ``(model, inputs) -> outputs``; default ``model(**inputs)`` for a dict, else ``model(inputs)``.
            On a cast it runs under ``torch.autocast`` to the cast's dtype (what it computes outside
            the model's modules is 16-bit inference too).
        loss_fn: ``(outputs, targets) -> loss``: the mean loss in fp32 and in each dtype is reported.
        classes: which outputs hold class scores in the last dim (top-1, top-k): ``"auto"``, True,
            False / ``"none"``, or output names (``"logits"``; a lone tensor is ``"output"``).
        topk: k of the top-k overlap (measured when there are more than k classes).
        thresholds: the verdict's gates (``Thresholds()`` by default).
        locate: on a non-finite output, run that batch again with module hooks to name the first
            module it came out of; on a degraded or broken output, the first module whose error passes the gate.

    Raises ``InferenceCheckError`` when the comparison cannot run: no batches, the fp32 forward
    raises or returns no floating-point tensor, an output fp32 never makes finite.
    """
    th = thresholds or Thresholds()
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    dts = dtypes_of(dtypes)
    fwd = forward or default_forward
    lows = {dt: cast_for_inference(model, dt, mode=mode, fp32_modules=fp32_modules, fp32_params=fp32_params)
            for dt in dts}
    low_fwd = _under_autocast(fwd, _device_of(model).type)
    results = {NAMES[dt]: DtypeResult(NAMES[dt], mode, cast=cast_info(lows[dt])) for dt in dts}
    stats: dict[torch.dtype, dict[str, OutputStats]] = {dt: {} for dt in dts}
    losses: dict[Any, list[float]] = {dt: [] for dt in (None, *dts)}
    device = _device_of(model)
    recorder = RangeRecorder(model) if torch.float16 in dts else None
    was_training = model.training
    model.eval()
    n = 0
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                n += 1
                inputs, targets = _split(batch, loss_fn, i)
                inputs, targets = to_device(inputs, device), to_device(targets, device)
                ref_out = _run_fp32(fwd, model, inputs, recorder, i)
                ref = _floating(ref_out)
                if not ref:
                    raise InferenceCheckError(
                        f"the model's forward returned {type(ref_out).__name__} with no floating-point tensor in it; "
                        "give a forward= that returns the outputs to compare (logits, embeddings...)")
                if loss_fn is not None:
                    losses[None].append(_fp32_loss(loss_fn, ref_out, targets, i))
                cls = _class_outputs(ref, classes)
                for dt in dts:
                    _compare_batch(results[NAMES[dt]], stats[dt], model, lows[dt], fwd, low_fwd, inputs, targets, ref,
                                   cls, loss_fn, losses[dt], dt, i, topk, th, locate)
    finally:
        model.train(was_training)
    if n == 0:
        raise InferenceCheckError("no batches to compare: give at least one batch of inputs")
    for dt in dts:
        _finish(results[NAMES[dt]], stats[dt], losses, dt, th, recorder)
    return InferenceReport(results, th, n, mode)


def _under_autocast(fwd: Callable[[nn.Module, Any], Any], device_type: str) -> Callable[[nn.Module, Any], Any]:
    """``fwd`` on a cast model, under autocast to its dtype: what a ``forward=`` computes outside the
    model's modules (``F.linear(x, model.head.weight)``, a product of two outputs) is 16-bit inference too."""
    def low_fwd(low: nn.Module, inputs: Any) -> Any:
        with torch.autocast(device_type, dtype=cast_info(low).dtype):  # type: ignore[union-attr]
            return fwd(low, inputs)
    return low_fwd


def _split(batch: Any, loss_fn: Any, i: int) -> tuple[Any, Any]:
    if loss_fn is None:
        return batch, None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InferenceCheckError(f"batch {i}: with loss_fn, each batch is an (inputs, targets) pair; "
                                  f"got {type(batch).__name__}")
    return batch[0], batch[1]


def _run_fp32(fwd: Callable[..., Any], model: nn.Module, inputs: Any, recorder: RangeRecorder | None, i: int) -> Any:
    try:
        if recorder is None:
            return fwd(model, inputs)
        with recorder:
            return fwd(model, inputs)
    except Exception as e:
        raise InferenceCheckError(
            f"the fp32 model's forward raised {type(e).__name__} on batch {i}: {e}. Low precision is not the "
            "cause: make the model run in fp32 on these batches first") from e


def _fp32_loss(loss_fn: Callable[[Any, Any], torch.Tensor], out: Any, targets: Any, i: int) -> float:
    try:
        return float(loss_fn(out, targets))
    except Exception as e:
        raise InferenceCheckError(f"the loss function raised {type(e).__name__} on the fp32 outputs of batch {i}: {e}; "
                                  "it takes (outputs, targets) as the forward returns them") from e


def _compare_batch(res: DtypeResult, st: dict[str, OutputStats], model: nn.Module, low: nn.Module,
                   fwd: Callable[..., Any], low_fwd: Callable[..., Any], inputs: Any, targets: Any,
                   ref: dict[str, torch.Tensor], cls: set[str], loss_fn: Any, losses: list[float], dt: torch.dtype, i: int, topk: int,
                   th: Thresholds, locate: bool) -> None:
    if res.error is not None:
        return
    try:
        low_out = low_fwd(low, inputs)
    except Exception as e:  # the 16-bit model does not run: the most broken of outcomes
        res.error = f"{type(e).__name__} on batch {i}: {e}"
        return
    got = _floating(low_out)
    if set(got) != set(ref) or any(got[k].shape != ref[k].shape for k in ref):
        shapes = {k: tuple(v.shape) for k, v in got.items()}
        ref_shapes = {k: tuple(v.shape) for k, v in ref.items()}
        res.error = f"outputs that differ from fp32's on batch {i}: fp32 {ref_shapes}, {res.dtype} {shapes}"
        return
    before = sum(s.nonfinite for s in st.values())
    for name, r in ref.items():
        s = st.get(name)
        if s is None:
            s = st[name] = OutputStats(name, tuple(r.shape), name in cls, topk, th.tie)
        s.add(r, got[name])
    if locate and res.failure is None and sum(s.nonfinite for s in st.values()) > before:
        res.failure = locate_nonfinite(model, low, lambda: fwd(model, inputs), lambda: low_fwd(low, inputs), dt, i)
    elif locate and res.degradation is None and res.failure is None and i == 0:
        bad = [s for s in st.values() if s.worst_batch_sqnr < th.agree_sqnr_db]
        if bad:
            res.degradation = locate_degradation(model, low, lambda: fwd(model, inputs), lambda: low_fwd(low, inputs),
                                                 th.agree_sqnr_db, i)
    if loss_fn is not None:
        try:
            losses.append(float(loss_fn(cast_floating(low_out, torch.float32), targets)))
        except Exception:  # a loss that cannot take this output: the outputs above are the comparison
            pass


def _finish(res: DtypeResult, st: dict[str, OutputStats], losses: dict[Any, list[float]], dt: torch.dtype,
            th: Thresholds, recorder: RangeRecorder | None) -> None:
    res.outputs = list(st.values())
    for o in res.outputs:
        if o.values == 0:
            raise InferenceCheckError(f"output {o.name!r}: the fp32 model gives no finite value on these batches; "
                                      "the fault is not the precision: fix it in fp32 first")
    if len(res.outputs) > 1:
        pooled = res.outputs[0]
        for o in res.outputs[1:]:
            pooled = pooled.merged(o, "all outputs")
        res.overall = pooled
    verdicts, reasons = [], []
    for o in res.outputs:
        v, why = judge(o, th)
        verdicts.append(v)
        reasons += why
    if res.error is not None:
        verdicts.append("broken")
        reasons.insert(0, "the forward raised" if not res.outputs else "the forward failed on a later batch")
    res.verdict, res.reasons = worst(verdicts), reasons
    if res.verdict == "agree":
        res.degradation = None  # a worst batch below the gate that the pooled numbers pass: not a finding
    if recorder is not None and dt == torch.float16:
        res.near_overflow = near_overflow(recorder, dt)
    if losses[None] and len(losses[dt]) == len(losses[None]):
        res.loss = (sum(losses[None]) / len(losses[None]), sum(losses[dt]) / len(losses[dt]))
