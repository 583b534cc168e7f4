"""The NaN guard's on-fault mode: a finiteness check per pass, and a traced replay of the first bad one.

``nan_guard(model, trace="on-fault")`` (the default of ``MixedPrecision(nan_guard=True)``) hooks the
root module only. Per forward it keeps what a replay needs: the inputs (references, with their
version counters), the RNG state of the CPU (and of the model's CUDA device), the autocast and grad
modes, and the version counters of the parameters and buffers. At the end of the forward it checks
the outputs (one max-|x| per output, one read); when backward reaches the outputs it keeps the
gradient that arrived at each of them, and at the end of backward it checks the parameters'
gradients (one max-|x| per gradient, one read).

When a check fails, the pass is replayed with the full trace (``diagnostics._trace``) attached:
the same inputs under the same RNG state and autocast; for a backward fault, the forward again and
then the model's backward from the saved output gradients, through ``torch.autograd.grad`` so no
``.grad`` is touched. The replay runs before any optimizer step can (the checks run at the end of
the forward and at the end of backward), so the parameters and optimizer state are those of the
failing pass and need no copy; their version counters say if something changed them anyway (an
optimizer run inside backward). Buffers a forward updates (batch-norm statistics) are restored after
the replay and the RNG state is put back, so the run continues as if no replay had happened.

A replay that sees no producer does not invent one: the event's origin is "unlocated" and its
``replay`` says what was seen and what may differ (dropout drawn from another RNG, inputs changed in
place, a kernel that is not deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._stats import _version, floating_tensors

MAX_PENDING = 16  # forwards kept for a backward that has not come (their inputs are held)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor (any dtype) in a nest of tuples, lists and dicts: the batch, as the forward got it."""
    out, stack = [], [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's gradients), else the tensor."""
    t = getattr(t, "_local_tensor", t)
    return t._values() if t.is_sparse else t


def screen(tensors: list[torch.Tensor]) -> list[int]:
    """Indices of the tensors that may hold a NaN or an infinity, in one read: never misses one.

    An fp32 sum (or 2-norm, for many tensors at once: one ``_foreach_norm``) of a tensor holding a
    NaN or an infinity is NaN or infinite. It can also overflow for a finite tensor of huge values,
    so ``nonfinite`` confirms before anything is reported. (The exact checks, ``isfinite`` or a
    max-norm, cost 5-10x more on the CPU: 1.2 ms against 0.14 ms for a tiny GPT-2's gradients.)
    """
    if not tensors:
        return []
    with torch._C.DisableTorchFunction():
        ts = [_local(t) for t in tensors]
        if len(ts) <= 4:
            vals = torch.stack([t.sum(dtype=torch.float32) for t in ts]).cpu().tolist()
        else:
            vals = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)).cpu().tolist()
    return [i for i, v in enumerate(vals) if not math.isfinite(v)]


def nonfinite(t: torch.Tensor) -> str | None:
    """"nan", "inf" or None: what ``t`` holds (exact; one sync)."""
    with torch._C.DisableTorchFunction():
        t = _local(t)
        if bool(torch.isnan(t).any()):
            return "nan"
        return "inf" if bool(torch.isinf(t).any()) else None


def _check(tensors: list[torch.Tensor]) -> tuple[str | None, list[int]]:
    """(kind, indices) of the tensors holding a NaN or an infinity: "nan" when any holds a NaN."""
    kinds = [(i, nonfinite(tensors[i])) for i in screen(tensors)]
    bad = [i for i, k in kinds if k is not None]
    if not bad:
        return None, []
    return ("nan" if any(k == "nan" for _, k in kinds) else "inf"), bad


@dataclasses.dataclass(eq=False)
class SavedPass:
    """One forward of the root module: what its replay needs, and what it gave."""

    args: tuple
    kwargs: dict
    rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    grad_enabled: bool
    inputs: list[tuple[torch.Tensor, int]]  # (tensor, version) of the batch
    state_versions: list[int]  # of the parameters and buffers, in Sentinel.state order
    step: int
    faulted: bool = False  # its outputs held a NaN or an infinity (reported when it ended)
    outputs: list[torch.Tensor] | None = None  # kept only when it faulted: the replay is compared with them
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output index -> gradient that arrived
    pending: bool = False  # waits for its backward in Sentinel.pending


@dataclasses.dataclass
class Replay:
    """What a replay saw: the trace (``records``/``ranges`` per checked part) and how faithful it was."""

    parts: list[tuple[list, Any]]  # (records, ranges) of each forward, then of the backward
    reproduced: bool  # the replay went non-finite where the original did
    notes: list[str]  # what differed from the original pass, or what could not be replayed


class Sentinel:
    """The on-fault guard's hooks on the root module (see the module docstring).

    ``guard`` is the ``NanGuard`` it reports to: its full ``Tracer`` (``guard._tracer``) is attached
    for replays only, and ``guard._replayed`` turns a replay's trace into events.
    """

    def __init__(self, guard: Any, model: nn.Module) -> None:
        self.guard = guard
        self.model = model
        self.forward_calls = 0
        self.pending: list[SavedPass] = []
        self.replaying = False
        self.dropped = 0  # forwards whose saved state was dropped before their backward came
        self.inf_outputs_expected = False  # a replay showed the outputs' infinities are asked for
        self._handles: list[Any] = []
        self._current: list[SavedPass] = []
        self._backward_queued = False
        self._params: list[tuple[str, nn.Parameter]] = []
        self._state: list[torch.Tensor] = []
        self._buffers: list[tuple[nn.Module, str]] = []
        self._cuda: torch.device | None = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        if self.attached:
            return
        m = self.model
        self._params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        self._state = [p for p in m.parameters()] + [b for b in m.buffers()]
        self._buffers = [(mod, name) for mod in m.modules() for name, b in mod.named_buffers(recurse=False) if b is not None]
        self._cuda = next((t.device for t in self._state if t.device.type == "cuda"), None)
        self._handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True),
                         m.register_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.pending = []
        self._current = []

    # ------------------------------------------------------------------ forward

    def _autocast_state(self) -> tuple[tuple[str, bool, torch.dtype], ...]:
        types = ("cpu", "cuda") if self._cuda is not None else ("cpu",)
        return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.replaying:
            return
        cuda_rng = None
        if self._cuda is not None:
            idx = self._cuda.index if self._cuda.index is not None else torch.cuda.current_device()
            cuda_rng = (idx, torch.cuda.get_rng_state(idx))
        self._current.append(SavedPass(
            args, dict(kwargs), torch.get_rng_state(), cuda_rng, self._autocast_state(), torch.is_grad_enabled(),
            [(t, _version(t)) for t in _tensors((args, kwargs))], [_version(t) for t in self._state],
            self.forward_calls + 1,
        ))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.replaying or not self._current:
            return
        saved = self._current.pop()
        self.forward_calls += 1
        outs = floating_tensors(output)
        if self.guard._fp8 is not None:
            self.guard._check_fp8()
        if not outs:
            return
        kind, bad = _check(outs)
        self.guard.checks += 1
        if kind == "inf" and self.inf_outputs_expected:
            kind = None
        if kind is not None:  # (raises in "raise" mode; "warn" and "record" watch its backward too)
            saved.faulted, saved.outputs = True, outs
            self.guard._on_fault(self, "forward", [saved], kind=kind, bad=[outs[i] for i in bad])
            saved.outputs = None
        if saved.grad_enabled:
            watched = False
            for i, t in enumerate(outs):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._grad_arrived, saved, i))
                    watched = True
            if watched:
                self._keep(saved)

    def _keep(self, saved: SavedPass) -> None:
        if saved.pending:
            return
        saved.pending = True
        self.pending.append(saved)
        if len(self.pending) > MAX_PENDING:  # forwards in grad mode that no backward followed
            self.pending.pop(0).pending = False
            self.dropped += 1

    # ------------------------------------------------------------------ backward

    def _grad_arrived(self, saved: SavedPass, index: int, grad: torch.Tensor) -> None:
        if self.replaying:
            return
        saved.grads[index] = grad
        self._keep(saved)  # a second backward through a retained graph
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        # Queued at the first gradient, this runs before callbacks queued later in the pass, such
        # as DDP's, which writes the gradients averaged over the ranks: queued again, the check
        # runs after them and sees what the optimizer will.
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._backward_queued = False
        done = [s for s in self.pending if s.grads]
        self.pending = [s for s in self.pending if not s.grads]
        for s in done:
            s.pending = False
        try:
            names, grads = [], []
            for n, p in self._params:
                if p.grad is not None:
                    names.append(n)
                    grads.append(p.grad)
            kind, bad = _check(grads)
            self.guard.checks += 1
            if kind is not None:
                self.guard._on_fault(self, "backward", done, kind=kind, bad=[grads[i] for i in bad],
                                     names=[names[i] for i in bad])
        finally:
            for s in done:
                s.grads = {}

    # ------------------------------------------------------------------ replay

    def replay(self, passes: list[SavedPass], backward: bool, bad_params: frozenset[str] = frozenset()) -> Replay:
        """Run ``passes`` again under the full trace; for ``backward``, then the model's backward
        from the gradients that arrived at their outputs. Restores the RNG and the buffers after."""
        notes = self._changes(passes)
        tracer = self.guard._tracer
        rng_now = torch.get_rng_state()
        cuda_now = None if self._cuda is None else [(s.cuda_rng[0], torch.cuda.get_rng_state(s.cuda_rng[0]))
                                                    for s in passes[:1] if s.cuda_rng is not None]
        # The replay runs on copies of the buffers, and the model's own tensors are put back after: writing
        # their old values back with copy_ bumped their version counters, and the original graph, which
        # saved some of them (BERT's token_type_ids, a BatchNorm's running stats), then refused its backward.
        buffers = [(mod, name, mod._buffers[name]) for mod, name in self._buffers if name in mod._buffers]
        copies: dict[int, torch.Tensor] = {}  # one copy per tensor: a buffer two modules share stays shared
        with torch.no_grad():
            for mod, name, value in buffers:
                if value is not None:
                    copy = copies.get(id(value))
                    if copy is None:
                        copy = copies[id(value)] = value.clone()
                    mod._buffers[name] = copy
        callbacks = (tracer.on_forward_end, tracer.on_backward_start, tracer.on_backward_end)
        tracer.on_forward_end = tracer.on_backward_start = tracer.on_backward_end = None
        keep_backward = tracer.backward
        tracer.backward = backward
        fp8 = self.guard._fp8
        if fp8 is not None:
            fp8.detach()  # the replay's casts are not the run's: not counted twice
        parts: list[tuple[list, Any]] = []
        outputs: list[list[torch.Tensor]] = []
        self.replaying = True
        tracer.attach()
        try:
            for s in passes:
                torch.set_rng_state(s.rng)
                if s.cuda_rng is not None:
                    torch.cuda.set_rng_state(s.cuda_rng[1], s.cuda_rng[0])
                with _modes(s.autocast, s.grad_enabled or backward):
                    out = self.model(*s.args, **s.kwargs)
                outs = floating_tensors(out)
                outputs.append(outs)
                parts.append(tracer.take())
            if backward:
                grads = self._replay_backward(passes, outputs, notes)
                parts.append(tracer.take())
                names = [n for (n, _), g in zip(self._params, grads) if g is not None]
                _, idx = _check([g for g in grads if g is not None])
                seen = frozenset(names[i] for i in idx)
                reproduced = bool(seen)
                if reproduced and seen != bad_params:
                    notes.append(f"the replay's non-finite gradients ({len(seen)} parameters) are not the "
                                 f"original's ({len(bad_params)})")
                elif reproduced:
                    notes.append("the same parameters' gradients went non-finite")
            else:
                reproduced = any(_check(o)[0] is not None for o in outputs)
                same = all(s.outputs is not None and len(o) == len(s.outputs) and all(map(_bitwise, o, s.outputs))
                           for s, o in zip(passes, outputs))
                if reproduced:
                    notes.append("its outputs are the original's bit for bit" if same else
                                 "its outputs differ from the original's (a random draw or state the replay "
                                 "could not restore)")
        finally:
            tracer.detach()
            self.replaying = False
            tracer.backward = keep_backward
            tracer.on_forward_end, tracer.on_backward_start, tracer.on_backward_end = callbacks
            for mod, name, value in buffers:
                mod._buffers[name] = value
            torch.set_rng_state(rng_now)
            for idx, state in cuda_now or ():
                torch.cuda.set_rng_state(state, idx)
            if fp8 is not None:
                fp8.attach()
        return Replay(parts, reproduced, notes)

    def _replay_backward(self, passes: list[SavedPass], outputs: list[list[torch.Tensor]],
                         notes: list[str]) -> list[torch.Tensor | None]:
        roots, grads_in = [], []
        for s, outs in zip(passes, outputs):
            for i, g in s.grads.items():
                if i < len(outs) and outs[i].requires_grad:
                    roots.append(outs[i])
                    grads_in.append(g)
        roots, grads_in = _external(roots, grads_in, notes)
        params = [p for _, p in self._params]
        with torch.enable_grad():
            if not roots:
                return []
            got = torch.autograd.grad(roots, params, grads_in, allow_unused=True)
        return list(got)

    def _changes(self, passes: list[SavedPass]) -> list[str]:
        """What changed since the original forward that the replay cannot undo."""
        notes = []
        for s in passes:
            if any(_version(t) != v for t, v in s.inputs):
                notes.append("an input was changed in place after the forward: the replay ran on its new value")
                break
        for s in passes:
            now = [_version(t) for t in self._state]
            if now != s.state_versions:
                n_params = sum(1 for _ in self.model.parameters())
                changed = [i for i, (a, b) in enumerate(zip(now, s.state_versions)) if a != b]
                if any(i < n_params for i in changed):
                    notes.append("parameters were changed after the forward (an optimizer inside backward?): the "
                                 "replay ran with their new values")
                else:
                    notes.append("buffers were updated by the forward (running statistics): the replay ran from "
                                 "their updated values")
                break
        return notes


class _modes:
    """The autocast and grad modes a forward ran under, entered again for its replay."""

    def __init__(self, autocast: tuple[tuple[str, bool, torch.dtype], ...], grad: bool) -> None:
        self.ctxs = [torch.autocast(t, dtype=dt, enabled=on) for t, on, dt in autocast]
        self.ctxs.append(torch.set_grad_enabled(grad))

    def __enter__(self) -> None:
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def _external(roots: list[torch.Tensor], grads: list[torch.Tensor], notes: list[str]) -> tuple[list, list]:
    """The gradients that reached the outputs from outside the model.

    A hook on an output sees the sum of what reached it, from outside and from the model's other
    outputs (a Hugging Face model returns its logits and the loss it computed from them). Injecting
    that sum at both would count the inside part twice, so an output that another output depends
    on gets only the outside part: nothing, when the inside part alone gives the saved gradient bit
    for bit (the usual case), else the difference (noted: rounded).
    """
    if len(roots) < 2:
        return roots, grads
    targets = {(r.grad_fn, r.output_nr): i for i, r in enumerate(roots) if r.grad_fn is not None}
    consumed: set[int] = set()
    for j, r in enumerate(roots):
        seen, todo = set(), [r.grad_fn]
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            for f, nr in n.next_functions:
                i = targets.get((f, nr))
                if i is not None and i != j:
                    consumed.add(i)
                todo.append(f)
    if not consumed:
        return roots, grads
    sinks = [i for i in range(len(roots)) if i not in consumed]
    keep_r = [roots[i] for i in sinks]
    keep_g = [grads[i] for i in sinks]
    with torch.enable_grad():
        inner = torch.autograd.grad(keep_r, [roots[i] for i in sorted(consumed)], keep_g,
                                    retain_graph=True, allow_unused=True)
    for i, c in zip(sorted(consumed), inner):
        g = grads[i]
        if c is None:
            c = torch.zeros_like(g)
        if _bitwise(c, g):
            continue
        keep_r.append(roots[i])
        keep_g.append(g - c)
        notes.append("an output that the model's other outputs depend on also received a gradient from outside: "
                     "its outside part was recovered by a subtraction (rounded)")
    return keep_r, keep_g


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN included (``torch.equal`` says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


__all__ = ["Replay", "SavedPass", "Sentinel", "nonfinite", "screen"]
