"""Time the reference block's training step under every recipe, interleaved, and set each result
against fp32 and against the machine's measured ceiling.

One ``Variant`` is a recipe plus the switches that change its speed but not its name (TF32 for fp32
matmuls on CUDA, ``torch.compile``). Each variant gets its own model (same seed), optimizer and
``MixedPrecision``; they all live at once so the rounds can interleave them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.bench.block import FLOP_FORMULA, RefBlock, Shape, block_flops, loss_fn, make_batches
from mixprec.instruments.activations import measure_activation_memory
from mixprec.bench.peak import measure_matmul_peak, peak_key, peak_keys, tf32
from mixprec.instruments.timing import Summary, count_syncs, interleaved_order, paired_ratio, synchronize, time_call
from mixprec.instruments.machine import environment
from mixprec.instruments.storage import LiveBytes, storage_bytes
from mixprec.recipes import list_recipes, resolve_recipe
from mixprec.training import MixedPrecision

Log = Callable[[str], None]
OPTIMIZERS = ("foreach", "fused", "forloop")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A recipe and the speed switches it runs with."""

    recipe: str
    tf32: bool = False
    compile: bool = False

    @property
    def label(self) -> str:
        return self.recipe + ("+tf32" if self.tf32 else "") + ("+compile" if self.compile else "")


def plan_variants(recipes: Sequence[str] | None, device: torch.device, tf32_mode: str = "both",
                  compile_mode: str = "off") -> list[Variant]:
    """The variants to run: every registered recipe (or ``recipes``: names, aliases or jmp policy
    strings), TF32 off/on for fp32 compute on CUDA (``tf32_mode`` "both"; "off"/"on" apply to every
    recipe), eager and/or compiled.

    Raises ValueError for an unknown recipe name or mode, RuntimeError for a recipe the device
    cannot run.
    """
    if tf32_mode not in ("off", "on", "both"):
        raise ValueError(f"tf32 must be 'off', 'on' or 'both', got {tf32_mode!r}")
    if compile_mode not in ("off", "on", "both"):
        raise ValueError(f"compile must be 'off', 'on' or 'both', got {compile_mode!r}")
    chosen = [resolve_recipe(r, device) for r in recipes] if recipes else list_recipes()
    # names and jmp policy strings, deduplicated; "auto" stays itself (it routes attention by a
    # measurement, so it is not the recipe it resolves to)
    compute = {("auto" if spec.strip().lower() == "auto" else r.name): r.compute_dtype
               for spec, r in zip(recipes or [r.name for r in chosen], chosen)}
    compiles = {"off": [False], "on": [True], "both": [False, True]}[compile_mode]
    out: list[Variant] = []
    for c in compiles:
        for name, dtype in compute.items():
            fp32_compute = dtype == torch.float32
            if device.type != "cuda":
                flags = [False]  # TF32 is a CUDA tensor-core mode
            elif tf32_mode == "both":
                flags = [False, True] if fp32_compute else [False]
            else:
                flags = [tf32_mode == "on"]
            out.extend(Variant(name, t, c) for t in flags)
    return out


def make_optimizer(params: Any, kind: str, lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW in one of torch's three implementations."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, lr=lr, **flags)


def default_optimizer(device: torch.device) -> str:
    return "fused" if device.type == "cuda" else "foreach"


def _raise_dynamo_cache_limit() -> None:
    # Every variant is the same RefBlock code under a different autocast/TF32 state: each needs its
    # own cache entry, and the default limit of 8 would silently drop later variants to eager.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(64, getattr(cfg, name)))


class Trainer:
    """One variant's model, optimizer and ``MixedPrecision``, and its training step."""

    def __init__(self, variant: Variant, shape: Shape, device: torch.device, optimizer: str, clip: float | None,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.variant = variant
        self.device = device
        self.clip = clip
        # a block is a model's middle: the fp8 rule that keeps a model's first and last linear in bf16
        # would leave half of it out, so every linear of the block computes in fp8 here
        fp8 = {"skip_first_last": False} if resolve_recipe(variant.recipe, device).fp8 is not None else None
        self.mp = MixedPrecision(variant.recipe, device, fp8=fp8)
        torch.manual_seed(0)
        model = RefBlock(shape).to(device)
        # prepare() stores parameters in 16 bits itself for the storage recipes (bf16-true, ...)
        model = self.mp.prepare(model)
        self.model: nn.Module = model
        self.forward_module: Callable[[torch.Tensor], torch.Tensor] = model
        if variant.compile:
            _raise_dynamo_cache_limit()
            self.forward_module = torch.compile(model)
        self.opt = make_optimizer(self.mp.parameters(model), optimizer)  # the fp32 masters where there are some
        self.batches = batches
        self.steps = 0

    def _tf32(self) -> contextlib.AbstractContextManager:
        return tf32(self.variant.tf32) if self.device.type == "cuda" else contextlib.nullcontext()

    def loss(self, i: int) -> torch.Tensor:
        x, y = self.batches[i % len(self.batches)]
        with self._tf32(), self.mp.autocast():
            out = self.forward_module(x)
        return loss_fn(out, y)  # outside autocast: the loss reduction runs in fp32

    def step(self) -> None:
        loss = self.loss(self.steps)
        with self._tf32():
            self.mp.step(loss, self.opt, max_grad_norm=self.clip)
        self.steps += 1

    def persistent_bytes(self) -> int:
        """What this variant holds between steps: weights, buffers, masters (and their
        compensation or remainders), optimizer state; each storage once."""
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *(p for g in self.opt.param_groups for p in g["params"]),
                   *(v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v))]
        if self.mp.masters is not None:
            tensors += [t for s in self.mp.masters.slots for t in self.mp.masters.extra_tensors(s)]
        return storage_bytes(tensors)

    def memory(self) -> dict[str, int | None]:
        """Activation memory of one forward, then the peak of one full step: this variant's
        persistent bytes plus the most the step held above them (CUDA: the allocator's peak less
        what was allocated before the step, so the other variants' models do not count; CPU: tensor
        storages alive, counted by ``LiveBytes``; not for compiled variants on the CPU)."""
        self.opt.zero_grad(set_to_none=True)
        cuda = self.device.type == "cuda"
        live = LiveBytes() if not cuda and not self.variant.compile else None
        persistent = self.persistent_bytes()
        with live if live is not None else contextlib.nullcontext():
            mem = measure_activation_memory(lambda: self.loss(0), self.model, self.device, inputs=self.batches[0],
                                            saved_tensors=not self.variant.compile, live=live)
            mem["persistent_bytes"] = persistent
            mem["peak_step"] = None
            if cuda:
                synchronize(self.device)
                before = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self.step()
                synchronize(self.device)
                mem["peak_step"] = persistent + torch.cuda.max_memory_allocated(self.device) - before
            elif live is not None:
                live.reset_peak()
                before = live.live
                self.step()
                mem["peak_step"] = persistent + live.peak - before
        return mem


def _baseline_for(v: Variant, labels: set[str]) -> str | None:
    for candidate in (Variant("fp32", False, v.compile).label, Variant("fp32").label):
        if candidate in labels:
            return candidate
    return None


def run_bench(
    shape: Shape,
    device: torch.device,
    variants: Sequence[Variant],
    *,
    rounds: int = 10,
    steps_per_round: int = 1,
    warmup: int = 2,
    optimizer: str | None = None,
    clip: float | None = 1.0,
    peaks: bool = True,
    peak_n: int | None = None,
    memory: bool = True,
    syncs: bool = True,
    budget_s: float | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return a JSON-ready dict (see docs/bench.md for its fields).

    A variant that fails to build or run is reported with ``status: "error"`` and its message; the
    others carry on.

    ``budget_s`` bounds the whole run (for a time-boxed GPU session, where a cold
    ``torch.compile`` of each variant can take tens of seconds): warm-ups (compilation included)
    may use 60% of it, and a variant that would start past that is reported with ``status:
    "skipped"``; the timed rounds stop early (at least 3) when the next round would not leave
    time for the measurements after them. ``settings.rounds_run`` says how many ran.
    """
    say = log or (lambda msg: None)
    t_start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - t_start
    optimizer = optimizer or default_optimizer(device)
    flops = block_flops(shape)
    batches = make_batches(shape, device)
    results: dict[str, dict[str, Any]] = {}
    trainers: dict[str, Trainer] = {}
    longest_warmup = 0.0
    for v in variants:
        res = results[v.label] = {"label": v.label, "recipe": v.recipe, "tf32": v.tf32, "compile": v.compile,
                                  "status": "ok", "error": None}
        # never before two variants have warmed up: the first pair is what a budgeted part is for
        # (compile-main: fp32 and bf16-mixed), however long their cold compiles take
        if budget_s is not None and len(trainers) >= 2 and elapsed() + longest_warmup > 0.6 * budget_s:
            res.update(status="skipped", error=f"time budget: {elapsed():.0f}s of {budget_s:.0f}s spent on warm-ups")
            say(f"{v.label}: skipped ({res['error']})")
            continue
        try:
            t = Trainer(v, shape, device, optimizer, clip, batches)
            say(f"warming up {v.label}")
            res["warmup_s"] = time_call(lambda: [t.step() for _ in range(warmup)], device)
            longest_warmup = max(longest_warmup, res["warmup_s"])
            trainers[v.label] = t
        except Exception as e:  # one broken recipe must not sink the table
            res.update(status="error", error=f"{type(e).__name__}: {e}")
            say(f"{v.label}: {res['error']}")

    samples: dict[str, list[float]] = {label: [] for label in trainers}
    order = interleaved_order(list(trainers), rounds)
    rounds_run = 0
    rounds_started = elapsed()
    for i, (r, label) in enumerate(order):
        if label in trainers:
            try:
                samples[label].append(time_call(trainers[label].step, device, steps_per_round))
            except Exception as e:
                results[label].update(status="error", error=f"{type(e).__name__}: {e}")
                del trainers[label]
        if (i + 1) % max(1, len(samples)) == 0:  # a round is over
            rounds_run = r + 1
            say(f"round {r + 1}/{rounds}")
            if budget_s is not None and rounds_run >= 3 and rounds_run < rounds:
                per_round = (elapsed() - rounds_started) / rounds_run
                # after the rounds: ~6 steps per variant (memory, syncs) and the matmul peaks
                after = sum(6 * Summary.of(samples[k]).median / steps_per_round for k in trainers if samples[k])
                if elapsed() + per_round + after + (10.0 if peaks else 0.0) > budget_s:
                    say(f"time budget: stopping after {rounds_run} of {rounds} rounds")
                    break

    peak_results: dict[str, dict] = {}
    if peaks:
        for key in peak_keys(device):
            say(f"measuring the {key} matmul peak")
            try:
                peak_results[key] = measure_matmul_peak(key, device, peak_n)
            except Exception as e:
                peak_results[key] = {"key": key, "error": f"{type(e).__name__}: {e}"}

    for label, t in trainers.items():
        res = results[label]
        s = Summary.of(samples[label])
        res["step_s"] = s.to_dict()
        res["samples_s"] = samples[label]
        res["tokens_per_s"] = shape.tokens / s.median
        res["achieved_flops_per_s"] = flops["step"] / s.median
        fp8 = t.mp.fp8
        key = peak_key(t.mp.policy.compute_dtype, t.variant.tf32, device, fp8=fp8 is not None and fp8.backend == "scaled_mm")
        if fp8 is not None:
            res["fp8_linears"] = f"{len(fp8.layers)} of {len(fp8.decisions)} ({fp8.backend})"
        peak = peak_results.get(key, {}).get("flops_per_s")
        res["peak_key"] = key
        res["peak_flops_per_s"] = peak
        res["ideal_s"] = flops["step"] / peak if peak else None
        res["peak_fraction"] = res["achieved_flops_per_s"] / peak if peak else None
        if memory:
            try:
                res["memory"] = t.memory()
            except Exception as e:
                res["memory"] = {"error": f"{type(e).__name__}: {e}"}
        res["syncs_per_step"] = None
        if syncs and device.type == "cuda":
            n = 3
            try:
                with count_syncs(device) as box:
                    for _ in range(n):
                        t.step()
                res["syncs_per_step"] = box[0] / n
            except Exception as e:  # keep the timings already taken
                res["syncs_error"] = f"{type(e).__name__}: {e}"

    for label in trainers:
        base = _baseline_for(trainers[label].variant, set(trainers))
        n = min(len(samples[base]), len(samples[label])) if base is not None else 0
        results[label]["speedup_vs_fp32"] = (
            None if base is None else {"baseline": base, **paired_ratio(samples[base][:n], samples[label][:n])}
        )

    return {
        "kind": "mixprec-bench",
        "version": 1,
        "env": environment(device),
        "shape": {**dataclasses.asdict(shape), "tokens": shape.tokens},
        "flops": {**flops, "formula": FLOP_FORMULA},
        "settings": {"rounds": rounds, "rounds_run": rounds_run, "steps_per_round": steps_per_round, "warmup": warmup,
                     "optimizer": f"AdamW({optimizer})", "max_grad_norm": clip, "budget_s": budget_s,
                     "elapsed_s": round(elapsed(), 1)},
        "peaks": peak_results,
        "results": list(results.values()),
    }
