"""``audit(step_fn, *example_args)``: what a training step really computes in, read from its jaxpr and its
compiled HLO, before a long job.

It traces the step (``jax.make_jaxpr``; nothing runs) and follows every value through it, recording
three things per value: the precision it carries (the narrowest format it was last rounded to: a
bf16 value widened to f32 still carries bf16 precision, an fp8 value dequantized by a scale still
carries fp8's), where a 16-bit value was widened back to f32, and its power of the loss scale (the
scale leaf in the arguments is ``+1``, ``1 / scale`` is ``-1``, a loss multiplied by the scale and
the gradients of it are ``+1``, unscaled gradients ``0``). From that it reports, each with the
source line that produced it:

- every ``dot_general`` and convolution, with its operand dtypes and the precision they carry;
- **findings**:

  - ``f32-matmul``: a matmul computing in f32 under a 16-bit policy (``policy=``, or inferred from
    the step's other matmuls), and ``undone-cast`` when its operands had been rounded to 16 bits and
    were widened back (``nnx.Embed(dtype=None)`` promoting the policy's bf16 table to f32 makes every
    later ``Linear`` compute in f32): the line of the widening is given;
  - ``16-bit-reduction``: a sum (``reduce_sum``, ``cumsum``) carried in bf16 or fp16;
  - ``16-bit-collective``: a ``psum`` / all-reduce / reduce-scatter in bf16 or fp16, from the jaxpr
    and from the compiled HLO (where ``jit`` over sharded inputs puts its all-reduces);
  - ``clip-before-unscale``: a comparison, ``min``, ``max`` or ``clip`` of a loss-scaled gradient (or
    of its norm) against an unscaled value, as ``optax.clip_by_global_norm`` run before the
    unscaling does.

A scale held as configuration (``StaticLossScale``, whose value is a compile-time constant) cannot
be followed; ``DynamicLossScale`` and ``skip_nonfinite``'s state can.

>>> import jax.numpy as jnp
>>> report = audit(lambda w, x: (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32).sum(),
...                jnp.ones((4, 2)), jnp.ones((3, 4)))
>>> [(d.lhs, d.rhs) for d in report.dots], report.ok
([('bfloat16', 'bfloat16')], True)
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from mixprec.jax.auditing_hlo import hlo_collectives

_MIXED = object()  # a power of the loss scale that is not one number (a sum of scaled and unscaled values)
_F32 = jnp.dtype(jnp.float32)
_LOW = {jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)}
_SUMS = {"reduce_sum", "cumsum", "reduce_precision_sum"}
_COLLECTIVES = {"psum", "psum2", "psum_invariant", "reduce_scatter", "psum_scatter", "all_reduce", "pmean"}
_COMPARES = {"lt", "gt", "le", "ge", "max", "min", "clamp"}
_LINEAR_1 = {"neg", "abs", "convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
             "expand_dims", "reduce_sum", "reduce_max", "reduce_min", "slice", "dynamic_slice", "gather", "copy",
             "copy_p", "rev", "pad", "real", "cumsum", "cummax", "reduce_precision", "sign", "stop_gradient",
             "optimization_barrier", "sharding_constraint", "pvary", "pcast", "psum", "psum_invariant", "pmean",
             "all_gather", "select_and_scatter_add", "reduce_window_sum", "squeeze_p"}
_JOIN = {"add", "sub", "add_any", "concatenate", "select_n", "max", "min", "clamp", "scatter-add", "scatter_add",
         "dynamic_update_slice", "scatter", "rem", "nextafter", "atan2"}


@dataclasses.dataclass
class Dot:
    """One matmul or convolution: operand dtypes, the precision their values carry, output dtype, where."""

    kind: str
    lhs: str
    rhs: str
    out: str
    carried: tuple[str, str]
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    where: str
    widened: str | None = None
    backward: bool = False

    def label(self) -> str:
        carried = "" if self.carried == (self.lhs, self.rhs) else f" (values rounded to {'/'.join(self.carried)})"
        return f"{self.kind} {self.lhs} x {self.rhs} -> {self.out}{carried}  {list(self.shapes[0])} x {list(self.shapes[1])}"


@dataclasses.dataclass
class Finding:
    """Something the step computes otherwise than its policy says: ``kind``, what, and the source line."""

    kind: str
    message: str
    where: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}\n    at {self.where}"


@dataclasses.dataclass
class AuditReport:
    """What ``audit`` found. ``ok`` when there are no findings; ``str(report)`` lists everything."""

    dots: list[Dot]
    findings: list[Finding]
    compute_dtype: str | None
    collectives: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def __str__(self) -> str:
        lines = [f"mixprec.jax.audit: {len(self.dots)} matmul(s)/convolution(s), compute dtype "
                 f"{self.compute_dtype or 'not 16-bit'}; {len(self.findings)} finding(s)"]
        counts = Counter((d.lhs, d.rhs, d.carried) for d in self.dots)
        for (lhs, rhs, carried), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            note = "" if carried == (lhs, rhs) else f" carrying {'/'.join(carried)}"
            lines.append(f"  {n:4d} x {lhs} x {rhs}{note}")
        for dtype, op, where in self.collectives:
            lines.append(f"  compiled {op} in {dtype} at {where}")
        lines += [str(f) for f in self.findings]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Info:
    carried: Any = None      # the dtype the values were last rounded to (None: not floating)
    widened: str | None = None  # where a <= 16-bit value was widened to f32
    power: Any = 0           # power of the loss scale (int, or _MIXED)
    norm: bool = False       # derived from a reduction over a loss-scaled tensor
    const: bool = False      # computed from literals only (neutral where values are added or selected)


def _where(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # a private API: without it, no line
        return "unknown"
    if not frames:
        return "unknown"
    cwd = os.getcwd() + os.sep

    def fmt(f: Any) -> str:
        name = f.file_name[len(cwd):] if f.file_name.startswith(cwd) else f.file_name
        return f"{name}:{f.start_line} ({f.function_name})"

    lib = ("site-packages", os.path.join("mixprec", "jax"))
    outside = next((f for f in frames if not any(s in f.file_name for s in lib)), None)
    if outside is None or outside is frames[0]:
        return fmt(frames[0])
    return f"{fmt(frames[0])}, from {fmt(outside)}"


def _dtype(v: Any) -> Any:
    aval = getattr(v, "aval", None)
    return getattr(aval, "dtype", None)


def _is_float(dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _narrowest(*dtypes: Any) -> Any:
    fl = [jnp.dtype(d) for d in dtypes if _is_float(d)]
    return min(fl, key=lambda d: (jnp.finfo(d).nmant, d.itemsize)) if fl else None


def _add_power(a: Any, b: Any, sign: int = 1) -> Any:
    if a is _MIXED or b is _MIXED:
        return _MIXED
    return a + sign * b


def _join_power(powers: list[Any]) -> Any:
    distinct = {p if p is not _MIXED else "m" for p in powers}
    if len(distinct) == 1:
        return powers[0]
    return _MIXED


def _scalar(v: Any) -> bool:
    aval = getattr(v, "aval", None)
    return getattr(aval, "shape", None) == ()


class _Auditor:
    def __init__(self, compute_dtype: Any) -> None:
        self.compute_dtype = compute_dtype
        self.dots: list[Dot] = []
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, str, str]] = set()

    def find(self, kind: str, message: str, where: str) -> None:
        key = (kind, message, where)
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(Finding(kind, message, where))

    def run(self, jaxpr: Any, infos: list[_Info]) -> list[_Info]:
        env: dict[Any, _Info] = {}

        def read(v: Any) -> _Info:
            if isinstance(v, jex_core.Literal):
                dt = _dtype(v)
                return _Info(jnp.dtype(dt) if _is_float(dt) else None, const=True)
            return env.get(v, _Info(jnp.dtype(_dtype(v)) if _is_float(_dtype(v)) else None))

        for v, info in zip(jaxpr.invars, infos):
            env[v] = info
        for v in getattr(jaxpr, "constvars", ()):
            env[v] = _Info(jnp.dtype(_dtype(v)) if _is_float(_dtype(v)) else None)
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, info in zip(eqn.outvars, outs):
                env[v] = info
        return [read(v) for v in jaxpr.outvars]

    def sub(self, eqn: Any, ins: list[_Info]) -> list[_Info] | None:
        """Recurse into the jaxprs an equation calls; the outputs' infos when they map one to one."""
        params = eqn.params
        name = eqn.primitive.name
        if name == "cond":
            outs = None
            for branch in params["branches"]:
                outs = self.run(branch.jaxpr, ins[1:])
            return outs
        if name == "while":
            nc, nb = params["cond_nconsts"], params["body_nconsts"]
            carry = ins[nc + nb:]
            self.run(params["cond_jaxpr"].jaxpr, ins[:nc] + carry)
            return self.run(params["body_jaxpr"].jaxpr, ins[nc:nc + nb] + carry)
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            sub = params.get(key)
            if sub is None:
                continue
            inner = getattr(sub, "jaxpr", sub)
            if not hasattr(inner, "eqns"):
                continue
            sub_ins = ins if len(inner.invars) == len(ins) else [_Info()] * len(inner.invars)
            outs = self.run(inner, sub_ins)
            return outs if len(outs) == len(eqn.outvars) else None
        return None

    def eqn(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
        name = eqn.primitive.name
        nested = self.sub(eqn, ins)
        if nested is not None:
            return nested
        out_dtypes = [_dtype(v) for v in eqn.outvars]
        out_float = [jnp.dtype(d) if _is_float(d) else None for d in out_dtypes]
        widened = next((i.widened for i in ins if i.widened), None)
        if name in ("dot_general", "conv_general_dilated"):
            self.dot(eqn, ins)
            power = _add_power(ins[0].power, ins[1].power)
            return [_Info(out_float[0], None, power, ins[0].norm or ins[1].norm)]
        if name in _SUMS and out_float[0] is not None and out_float[0] in _LOW:
            grad = " (in the backward pass: e.g. a bias's gradient summed over the batch)" if "transpose(" in str(
                getattr(eqn.source_info, "name_stack", "")) else ""
            self.find("16-bit-reduction", f"{name} carried in {out_float[0].name}{grad}: its result is rounded to "
                      f"{jnp.finfo(out_float[0]).nmant + 1} bits, and so may be each partial sum (only some backends keep "
                      "a wider accumulator); sum in f32 (jnp.sum(x, dtype=jnp.float32))", _where(eqn))
        if name in _COLLECTIVES and out_float and out_float[0] in _LOW:
            self.find("16-bit-collective", f"{name} over {eqn.params.get('axes', eqn.params.get('axis_name'))} in "
                      f"{out_float[0].name}: the reduction rounds every partial sum to 16 bits (and a loss-scaled "
                      "fp16 sum overflows where its parts do not); reduce in f32, e.g. with "
                      "mixprec.jax.cast_to_compute_varying before the cast", _where(eqn))
        if name in _COMPARES:
            self.compare(eqn, ins)
        if name == "convert_element_type":
            return [self.convert(eqn, ins[0], out_float[0])]
        powers = [i.power for i in ins if i.carried is not None and not i.const]
        norm = any(i.norm for i in ins)
        const = bool(ins) and all(i.const for i in ins)
        if name == "mul":
            power = _add_power(ins[0].power, ins[1].power)
        elif name == "div":
            power = _add_power(ins[0].power, ins[1].power, -1)
        elif name in ("integer_pow", "square"):
            y = eqn.params.get("y", 2)
            power = ins[0].power if ins[0].power is _MIXED else ins[0].power * y
        elif name in ("sqrt", "rsqrt"):
            p = ins[0].power
            power = p if p is _MIXED or p == 0 else (p / 2 if name == "sqrt" else -p / 2)
        elif name in _LINEAR_1:
            power = ins[0].power if ins else 0
            if name in ("reduce_sum", "reduce_max", "reduce_min") and power not in (0, _MIXED) and not _scalar(eqn.invars[0]):
                norm = True
        elif name in _JOIN:
            power = _join_power(powers) if powers else 0
        elif name in ("is_finite", "eq", "ne", "and", "or", "not", "lt", "gt", "le", "ge", "iota", "argmax", "argmin",
                      "sign", "floor", "ceil", "round"):
            power = 0 if name not in ("sign", "floor", "ceil", "round") else (ins[0].power if ins else 0)
        else:  # exp, log, tanh, ...: nonlinear in the scale
            power = _MIXED if any(p not in (0,) for p in powers) else 0
        carried = None
        if out_float and out_float[0] is not None:
            carried = out_float[0]
            if name in ("mul", "div") and len(ins) == 2:
                # a per-tensor scale keeps the other operand's precision class (a dequantization)
                big, small = (0, 1) if _scalar(eqn.invars[1]) else (1, 0) if _scalar(eqn.invars[0]) else (None, None)
                if big is not None and ins[big].carried is not None:
                    carried = _narrowest(ins[big].carried, out_float[0])
            elif name in _LINEAR_1 and ins and ins[0].carried is not None:
                carried = _narrowest(ins[0].carried, out_float[0])
        return [_Info(carried if d is not None else None, widened if d is not None else None, power, norm, const)
                for d in out_float]

    def convert(self, eqn: Any, src: _Info, new: Any) -> _Info:
        if new is None:
            return _Info(None, None, 0)
        old = jnp.dtype(_dtype(eqn.invars[0])) if _is_float(_dtype(eqn.invars[0])) else None
        if old is None:
            return _Info(new, None, src.power, src.norm, src.const)
        if new.itemsize >= old.itemsize:  # a widening: exact, the values keep their precision
            carried = _narrowest(src.carried or old, new)
            widened = src.widened
            if widened is None and carried in _LOW and new not in _LOW:
                widened = f"{_where(eqn)} (convert {old.name} -> {new.name})"
            return _Info(carried, widened, src.power, src.norm, src.const)
        return _Info(new, None, src.power, src.norm, src.const)  # a rounding

    def dot(self, eqn: Any, ins: list[_Info]) -> None:
        lhs, rhs = (jnp.dtype(_dtype(v)) for v in eqn.invars[:2])
        carried = tuple((i.carried or d).name for i, d in zip(ins[:2], (lhs, rhs)))
        kind = "conv" if eqn.primitive.name == "conv_general_dilated" else "dot_general"
        where = _where(eqn)
        shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars[:2])
        widened = next((i.widened for i in ins[:2] if i.widened), None)
        backward = "transpose(" in str(getattr(eqn.source_info, "name_stack", ""))
        self.dots.append(Dot(kind, lhs.name, rhs.name, jnp.dtype(_dtype(eqn.outvars[0])).name, carried, shapes, where,
                             widened, backward))

    def judge_dots(self) -> None:
        cd = self.compute_dtype
        if cd is None:
            return
        for d in self.dots:
            # the forward's matmuls decide (a backward matmul takes its dtypes from its forward one, and the
            # transpose of a cast to 16 bits is a widening by design)
            if d.backward or (d.lhs != "float32" and d.rhs != "float32"):
                continue
            low = [c for c in d.carried if jnp.dtype(c) in _LOW]
            if any(jnp.dtype(c) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)) for c in d.carried):
                continue  # an fp8 dot: dequantized fp8 operands, multiplied in f32 by design
            if low:
                undone = d.widened
                self.find("undone-cast", f"a {d.kind} computes in f32 on values rounded to {'/'.join(low)}: the "
                          f"policy's {cd.name} cast was undone" + (f" at {undone}" if undone else "") +
                          " (a layer built with dtype=None promotes to its f32 parameters; give it the compute dtype)",
                          d.where)
            else:
                self.find("f32-matmul", f"a {d.kind} computes in f32 ({d.lhs} x {d.rhs}) under a {cd.name} policy: "
                          "its operands never got the policy's cast", d.where)

    def compare(self, eqn: Any, ins: list[_Info]) -> None:
        floats = [(i, v) for i, v in zip(ins, eqn.invars) if i.carried is not None]
        scaled = [(i, v) for i, v in floats if i.power not in (0, _MIXED) and (i.norm or not _scalar(v))]
        plain = [(i, v) for i, v in floats if i.power == 0]
        if scaled and plain:
            what = "the norm of a loss-scaled gradient" if any(i.norm for i, _ in scaled) else "a loss-scaled gradient"
            self.find("clip-before-unscale", f"{eqn.primitive.name}: {what} compared with an unscaled value (a clip "
                      "applied before the unscaling clips the scaled gradient). Unscale first: with skip_nonfinite, "
                      "put the clip inside it: skip_nonfinite(optax.chain(optax.clip_by_global_norm(...), opt), recipe)",
                      _where(eqn))


def _scale_leaves(args: Any) -> list[bool]:
    """Which flattened leaves of ``args`` are a loss scale's value (``DynamicLossScale.loss_scale``)."""
    from mixprec.jax.loss_scale import DynamicLossScale

    marks: list[bool] = []

    def visit(x: Any) -> None:
        if isinstance(x, DynamicLossScale):
            leaves = jax.tree_util.tree_leaves(x)
            marks.extend([True] + [False] * (len(leaves) - 1))
        else:
            marks.extend([False] * len(jax.tree_util.tree_leaves(x)))

    for leaf in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, DynamicLossScale)):
        visit(leaf)
    return marks


def _compute_dtype(policy: Any) -> Any:
    if policy is None:
        return None
    from mixprec.jax.policy import Policy, get_policy
    from mixprec.jax.recipes import JaxRecipe, get_recipe

    if isinstance(policy, JaxRecipe):
        policy = policy.policy
    elif isinstance(policy, str):
        policy = get_recipe(policy).policy if "=" not in policy else get_policy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"audit's policy= takes a Policy, a JaxRecipe or a recipe name, got {type(policy).__name__}")
    d = jnp.dtype(policy.compute_dtype)
    return d if d in _LOW else None


def audit(step_fn: Callable[..., Any], *example_args: Any, policy: Any = None, compiled: bool = True,
          **example_kwargs: Any) -> AuditReport:
    """Trace ``step_fn(*example_args, **example_kwargs)`` and report what it computes in (module docstring).

    ``policy``: the policy (or recipe) the step is meant to follow; by default the 16-bit dtype most of
    its matmuls use. ``compiled``: also compile the step and read its collectives from the HLO (the
    all-reduces ``jit`` inserts over sharded inputs appear only there).
    """
    closed = jax.make_jaxpr(step_fn)(*example_args, **example_kwargs)
    marks = _scale_leaves((example_args, example_kwargs))
    infos = []
    for v, is_scale in zip(closed.jaxpr.invars, marks + [False] * (len(closed.jaxpr.invars) - len(marks))):
        dt = _dtype(v)
        infos.append(_Info(jnp.dtype(dt) if _is_float(dt) else None, None, 1 if is_scale else 0))
    auditor = _Auditor(_compute_dtype(policy))
    auditor.run(closed.jaxpr, infos)
    if auditor.compute_dtype is None and policy is None:
        low = Counter(jnp.dtype(d.lhs) for d in auditor.dots if jnp.dtype(d.lhs) in _LOW and d.lhs == d.rhs
                      and jnp.dtype(d.lhs).itemsize == 2)
        auditor.compute_dtype = low.most_common(1)[0][0] if low else None
    collectives: list[tuple[str, str, str]] = []
    if compiled:
        text = jax.jit(step_fn).lower(*example_args, **example_kwargs).compile().as_text()
        collectives = hlo_collectives(text)
        for dtype, op, where in collectives:
            if dtype in ("bf16", "f16"):
                auditor.find("16-bit-collective", f"the compiled step's {op} runs in {dtype}: the reduction rounds every "
                             "partial sum to 16 bits (a loss-scaled fp16 sum overflows where its parts do not); under "
                             "jit over sharded inputs compute the gradient under shard_map with "
                             "mixprec.jax.cast_to_compute_varying", where)
    auditor.judge_dots()
    name = auditor.compute_dtype.name if auditor.compute_dtype is not None else None
    return AuditReport(auditor.dots, auditor.findings, name, collectives)
