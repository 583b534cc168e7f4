"""The memory planner: bytes of weights, gradients, masters, optimizer state and activations.

Pure arithmetic, no torch: ``StorageFacts`` says what a recipe stores (``facts_from_recipe`` reads
them off a ``Recipe`` and its master-weight strategy), ``ParamCounts`` how many parameters there
are and of which kind, ``plan`` adds them up. ``mixprec memory`` prints the plan, and with
``--measure`` the bytes one real step used (``mixprec.memory.measure``).

The seed's figure: AdamW keeps two fp32 moments per parameter, so 7B parameters need
7e9 * 2 * 4 B = 56 GB of optimizer state, whatever the recipe.

>>> p = plan(ParamCounts(7_000_000_000), StorageFacts("bf16-mixed", 4, 2, autocast=True), "adamw")
>>> p.bytes["optimizer state"] / 1e9
56.0

When each component is alive (what ``peak`` assumes):

- persistent: weights, masters, optimizer state.
- forward/backward: + gradients, + autocast's 16-bit weight copies (mixed recipes: saved for
  backward; an fp8 recipe's fp8 linears save an fp8 copy instead, 1 B/param), + activations saved for backward, + the logits' gradient that backward starts with
  (tokens x vocab x 4 B, given a shape). All gradients beside all activations overestimates
  (backward frees activations as gradients arrive); other transients of backward are left out:
  measured CPU peaks of the built-in model are 0.86-1.02 of the plan (tests/memory).
- optimizer step: 16-bit storage recipes turn 16-bit gradients into fp32 master gradients there
  (freeing the 16-bit ones), one bucket at a time, in the bucket's turn (the 16-bit ones wait
  on the model, where a loss scaler checks them; with the per-parameter optimizers planned
  here). The compact strategies (Kahan, SR, remainder) also rebuild an fp32 value for the weights
  of one bucket at a time; plus the temporaries of one bucket of the master-weight step
  (``StorageFacts.step_temp_bytes``). Optimizer temporaries are not counted: fused and
  per-tensor kernels make none; torch's foreach kernels add up to 4 B/param.
- gradient accumulation (``plan(..., accumulate=k)``): 16-bit storage recipes keep fp32
  accumulators (4 B per trainable 16-bit parameter) through each window, beside every backward.

Per rank, data parallel (``plan(..., world_size=N, parallel="fsdp" | "ddp")``; shapes are per rank):

- ``fsdp`` (FSDP2): weights, gradients and optimizer state are sharded, ``1/N`` each, all in
  fp32 (the sharded fp32 weights are a 16-bit storage recipe's masters, so ``masters`` is 0 and
  the optimizer steps them in place: no step-time fp32). The compute copies (the all-gathered
  16-bit parameters: the ``autocast weight copies`` row) and activations are not divided; the
  copies are counted whole, an upper bound: FSDP2 gathers one unit at a time and frees it after
  its forward. With accumulation FSDP2 keeps unsharded fp32 gradients through the window.
  Dimension 0 of each tensor is padded to a multiple of N (a row per tensor at most).
- ``ddp``: every rank holds what one process holds; 16-bit storage recipes make the fp32 master
  gradients of the whole model at the boundary (they are averaged over the ranks before the
  step), not a bucket at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mixprec._env import workspace_limit  # (no torch: the arithmetic path stays torch-free)

GB = 1e9  # decimal gigabytes, as the seeds quote them

#: fp32 optimizer state per parameter, in bytes (every mixprec recipe keeps optimizer state fp32).
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg, exp_avg_sq
    "adam": 8,
    "sgd": 0,
    "sgd-momentum": 4,  # momentum_buffer
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg
}

COMPONENTS = (
    "weights", "masters", "optimizer state", "gradients", "fp32 grad accumulators", "autocast weight copies",
    "activations", "step-time fp32",
)


@dataclasses.dataclass(frozen=True)
class StorageFacts:
    """What a recipe stores, in bytes per element.

    Attributes:
        name: the recipe's name (for display).
        param_bytes: bytes per stored parameter of the kind the recipe casts (4 or 2).
        compute_bytes: bytes per activation element in the compute dtype.
        master_bytes: bytes per 16-bit parameter the master-weight strategy keeps (fp32 copy 4,
            Kahan compensation 2, int16 remainder 2, stochastic rounding 0).
        step_bytes: fp32 bytes per 16-bit parameter alive only during the optimizer step (the
            fp32 gradient: 4).
        step_value_bytes: fp32 bytes per 16-bit parameter of one bucket rebuilt for the step by
            strategies that keep no fp32 copy (4; 0 for fp32 masters).
        defers_grads: the step keeps the 16-bit gradients until each bucket's turn and makes
            fp32 gradients one bucket at a time (16-bit storage, a loss scaler or not: it checks
            them where they wait; planned for ``accumulate=1``: accumulation keeps fp32 gradients
            for the whole model).
        autocast: the forward casts fp32 weights to the compute dtype (mixed recipes).
        norm_bytes: bytes per element of the residual stream and norm inputs (fp32 under mixprec's
            recipes: embeddings and norms stay fp32, so the residual sum stays fp32; the compute
            bytes for a pure recipe without fp32 islands, fp16-pure, which keeps both in 16 bits).
        prob_bytes: bytes saved per attention probability (eager attention). None: the compute
            bytes, as on CPU. CUDA autocast runs softmax in fp32, which saves the fp32 output
            for softmax's backward and its 16-bit cast for the next matmul: 4 + compute bytes.
        step_temp_bytes, bucket_numel: the master-weight step works on buckets of up to
            ``bucket_numel`` parameters and allocates ``step_temp_bytes`` per element of one
            bucket on top of the step-time fp32 memory (noticeable only for small models).
        fp8: an fp8 recipe: the weights of its fp8 linears are copied to fp8 (1 B) for the step,
            not to the compute dtype (``ParamCounts.fp8_weights`` says how many).
        fsdp_refused: why ``prepare(parallel="fsdp")`` refuses the recipe (None: it runs), so
            that no per-rank FSDP2 plan is made for a set-up that cannot run.
        kept_bytes: on a CPU, the bytes per element of one bucket of the step's temporaries that
            stay allocated between steps (so through the forward and backward too), as
            ``MIXPREC_MASTER_WORKSPACE`` says: all of them under "keep", at most 64 MiB under "auto"
            (the default), none under "free"; 0 on CUDA.
    """

    name: str
    param_bytes: int
    compute_bytes: int
    master_bytes: int = 0
    step_bytes: int = 0
    step_value_bytes: int = 0
    defers_grads: bool = False
    autocast: bool = False
    norm_bytes: int = 4
    prob_bytes: int | None = None
    step_temp_bytes: int = 0
    bucket_numel: int = 0
    fp8: bool = False
    fsdp_refused: str | None = None
    kept_bytes: int = 0

    @property
    def stores_16bit(self) -> bool:
        return self.param_bytes < 4


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """How many parameters, and how many of each kind.

    Attributes:
        total: every floating parameter.
        fp32_kept: of those, how many a 16-bit storage recipe keeps in fp32 (its fp32 rule).
        matmul_weights: weights that autocast casts to 16 bits and saves (Linear/Conv weights);
            None means all of them (the upper bound used for a bare ``--params`` count).
        frozen: of ``total``, how many are frozen (``requires_grad=False``): no gradients, no
            optimizer state, and no masters (16-bit storage recipes store them in 16 bits only).
        frozen_fp32_kept: of the frozen ones, how many the fp32 rule keeps in fp32.
        largest: elements of the largest trainable tensor a 16-bit storage recipe stores in 16
            bits (0: unknown). The master-weight step works on buckets of up to 2**24 elements,
            but a tensor larger than that (a 32000 x 4096 embedding) is a bucket of its own.
        fp8_weights: of the matmul weights, those an fp8 recipe computes in fp8 (``mixprec.fp8``'s
            rules); None means all of them.
    """

    total: int
    fp32_kept: int = 0
    matmul_weights: int | None = None
    frozen: int = 0
    frozen_fp32_kept: int = 0
    largest: int = 0
    fp8_weights: int | None = None

    def __post_init__(self) -> None:
        if self.total < 0 or not 0 <= self.fp32_kept <= self.total:
            raise ValueError(f"parameter counts must satisfy 0 <= fp32_kept <= total, got {self}")
        if not 0 <= self.frozen <= self.total or not 0 <= self.frozen_fp32_kept <= min(self.frozen, self.fp32_kept):
            raise ValueError(
                f"parameter counts must satisfy 0 <= frozen <= total and "
                f"0 <= frozen_fp32_kept <= min(frozen, fp32_kept), got {self}"
            )

    @property
    def trainable(self) -> int:
        return self.total - self.frozen


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A GPT-style decoder for the activation estimate.

    Assumptions (``activation_bytes`` states the formula): pre-norm blocks with one attention and
    one 4x MLP with GELU, no dropout, activations saved by autograd (no checkpointing), the
    residual stream in ``norm_bytes``. ``attention="eager"`` keeps the softmax probabilities
    (heads * seq**2 per sequence); ``"flash"`` keeps only a row log-sum-exp.
    """

    batch: int
    seq: int
    d_model: int
    layers: int
    heads: int
    vocab: int = 0
    attention: str = "eager"

    def __post_init__(self) -> None:
        for field in ("batch", "seq", "d_model", "layers", "heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"transformer shape needs {field} >= 1, got {getattr(self, field)}")
        if self.vocab < 0:
            raise ValueError(f"transformer shape needs vocab >= 0 (0: no log-probabilities), got {self.vocab}")
        if self.attention not in ("eager", "flash"):
            raise ValueError(f"attention must be 'eager' or 'flash', got {self.attention!r}")
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} is not a multiple of --heads {self.heads}: each head gets "
                             "d_model / heads channels (e.g. --d-model 4096 --heads 32)")


def activation_bytes(shape: TransformerShape, facts: StorageFacts) -> int:
    """Bytes autograd saves for backward in one forward of ``shape``.

    Per layer, with t = batch * seq tokens, h = d_model, c = compute bytes, r = norm bytes:
      t*h*(14c + 2r)   14 h-wide tensors in the compute dtype (qkv input, q/k/v, attention output,
                       MLP input, GELU input and output at 4h) and the two norm inputs;
      + t*16           the two norms' mean and rstd (fp32);
      + eager: heads * seq * t * c (softmax probabilities; 4 + c under CUDA autocast, see
        ``StorageFacts.prob_bytes``); flash: heads * t * 4 (log-sum-exp).
    Plus the head: final norm input t*h*r, head input t*h*c, fp32 log-probabilities t*vocab*4,
    token ids and targets t*16. fp8 recipes: the fp8 linears save their inputs in fp8, so the 7 h-wide
    linear inputs of a layer (qkv, proj, MLP in and out) take 1 byte, not c, except the model's first
    linear (block 0's qkv), which the default rules keep in bf16 (the head is the last one). With c=2, r=2 and dropout this is Korthikanti et al. (2022)'s
    34*s*b*h + 5*a*s**2*b; mixprec recipes keep the residual stream fp32 (r=4; r=c for a pure recipe
    without fp32 islands, fp16-pure) and there is no dropout.
    """
    t, h, c, r = shape.batch * shape.seq, shape.d_model, facts.compute_bytes, facts.norm_bytes
    probs = c if facts.prob_bytes is None else facts.prob_bytes
    attn = shape.heads * shape.seq * t * probs if shape.attention == "eager" else shape.heads * t * 4
    per_layer = t * h * (14 * c + 2 * r) + 16 * t + attn
    head = t * h * (r + c) + t * shape.vocab * 4 + 16 * t + 8 * t
    fp8_saving = (c - 1) * t * h * (7 * shape.layers - 1) if facts.fp8 else 0
    return shape.layers * per_layer + head - fp8_saving


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes by component (see ``COMPONENTS``) and the totals they add up to."""

    recipe: str
    optimizer: str
    counts: ParamCounts
    bytes: dict[str, int]
    persistent: int
    forward_backward: int
    step: int
    peak: int
    notes: tuple[str, ...] = ()
    world_size: int = 1  # per rank of this many, under ``parallel`` ("ddp", "fsdp"; None: one process)
    parallel: str | None = None

    def per_param(self, component: str) -> float:
        return self.bytes[component] / self.counts.total if self.counts.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "optimizer": self.optimizer,
            "params": dataclasses.asdict(self.counts),
            "bytes": dict(self.bytes),
            "bytes_per_param": {k: self.per_param(k) for k in self.bytes},
            "persistent": self.persistent,
            "forward_backward_peak": self.persistent + self.forward_backward,
            "step_peak": self.persistent + self.step,
            "peak": self.peak,
            "notes": list(self.notes),
            "world_size": self.world_size,
            "parallel": self.parallel,
        }


def optimizer_state_bytes(optimizer: str) -> int:
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r} for the memory plan; expected one of {', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    return OPTIMIZER_STATE_BYTES[key]


def plan(
    counts: ParamCounts,
    facts: StorageFacts,
    optimizer: str = "adamw",
    shape: TransformerShape | None = None,
    accumulate: int = 1,
    world_size: int = 1,
    parallel: str | None = None,
) -> Plan:
    """The bytes a recipe needs for ``counts`` parameters trained with ``optimizer``.

    ``accumulate`` > 1 (gradient accumulation over micro-batches): a 16-bit storage recipe adds
    each micro-batch's 16-bit gradients into fp32 accumulators on the masters (4 B per trainable
    16-bit parameter through the window, beside the next micro-batch's backward); fp32 parameters
    accumulate in their own ``.grad`` at no extra cost."""
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an integer >= 1, got {accumulate!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if parallel not in (None, "ddp", "fsdp"):
        raise ValueError(f"parallel must be 'ddp', 'fsdp' or None, got {parallel!r}")
    if parallel == "fsdp" and facts.fsdp_refused:
        raise ValueError(f"no FSDP2 plan for recipe {facts.name!r}: prepare(parallel='fsdp') refuses it "
                         f"({facts.fsdp_refused}). Plan it with --parallel ddp, or plan 'bf16-true' under fsdp")
    if parallel == "fsdp":
        return _fsdp_plan(counts, facts, optimizer, shape, accumulate, world_size)
    n = counts.total
    stores_16bit = facts.stores_16bit
    n16 = n - counts.fp32_kept if stores_16bit else 0
    n32 = n - n16
    # the trainable ones: frozen parameters have no gradient, optimizer state or master
    t16 = n16 - (counts.frozen - counts.frozen_fp32_kept if stores_16bit else 0)
    t32 = counts.trainable - t16
    matmul = n if counts.matmul_weights is None else counts.matmul_weights
    # the largest bucket of the master-weight step (a tensor larger than a bucket is one alone)
    bucket = min(t16, max(facts.bucket_numel, counts.largest)) if facts.bucket_numel else t16
    accumulators = t16 * 4 if accumulate > 1 else 0
    fp8w = (matmul if counts.fp8_weights is None else counts.fp8_weights) if facts.fp8 else 0  # 1 B copies
    # accumulated gradients are fp32 already; under DDP they are made fp32 whole, to be averaged
    defers = facts.defers_grads and accumulate == 1 and parallel is None
    b = {
        "weights": n16 * facts.param_bytes + n32 * 4,
        "masters": t16 * facts.master_bytes,
        "optimizer state": counts.trainable * optimizer_state_bytes(optimizer),
        "gradients": t16 * facts.param_bytes + t32 * 4,
        "fp32 grad accumulators": accumulators,
        "autocast weight copies": (matmul - fp8w) * facts.compute_bytes + fp8w if facts.autocast and not stores_16bit else 0,
        "activations": activation_bytes(shape, facts) if shape is not None else 0,
        # the fp32 gradients of every 16-bit parameter (of one bucket, when they are made bucket
        # by bucket) and the rebuilt values of one bucket
        "step-time fp32": (bucket if defers else t16) * facts.step_bytes + bucket * facts.step_value_bytes,
    }
    persistent = b["weights"] + b["masters"] + b["optimizer state"]
    # backward starts with the logits' gradient (fp32: the recipes' output dtype) while every
    # activation is still alive: a transient, not a component, but part of the peak
    logits_grad = shape.batch * shape.seq * shape.vocab * 4 if shape is not None else 0
    fwd_bwd = b["gradients"] + accumulators + b["autocast weight copies"] + b["activations"] + logits_grad
    limit = workspace_limit()  # what the step keeps between steps on a CPU (facts.kept_bytes is 0 elsewhere)
    kept = bucket * facts.kept_bytes if t16 and facts.bucket_numel and limit != 0 else 0
    kept = kept if limit is None else min(kept, limit)
    fwd_bwd += kept  # (in the step they are its temporaries, counted there already)
    # at the step the 16-bit gradients have become fp32 master gradients (counted in step-time),
    # or wait on the model for their bucket's turn (a bucket's own are freed once made fp32)
    # (the accumulators are the step's fp32 gradients: counted in step-time, not again)
    step = t32 * 4 + b["step-time fp32"] + ((t16 - bucket) * facts.param_bytes if defers else 0)
    if t16:  # one bucket's temporaries in the master-weight step
        step += bucket * facts.step_temp_bytes
    notes = []
    if counts.matmul_weights is None and facts.autocast and not stores_16bit:
        notes.append("autocast copies assume every parameter is a matmul weight (an upper bound)")
    if facts.fp8 and counts.fp8_weights is None:
        notes.append("fp8 copies assume every matmul weight computes in fp8 (pass --model to apply the rules)")
    if facts.fp8:
        notes.append("fp8: the casts' fp32 temporaries (and, emulated on CPU, each GEMM's fp32 operands) are "
                     "transients left out of the plan")
    if stores_16bit and counts.fp32_kept == 0 and counts.matmul_weights is None:  # a bare count, not a model
        notes.append("every parameter counted as stored in 16 bits (pass a model to apply the fp32 rule)")
    if t16 > facts.bucket_numel > 0 and not counts.largest and facts.step_value_bytes + facts.step_temp_bytes:
        notes.append(f"the master-weight step is planned in buckets of {facts.bucket_numel:,} parameters; a larger "
                     "single tensor (an untied LM head) is a bucket of its own: pass --model to count it")
    if kept:
        how = ("=keep: " if limit is None else
               f"=auto (the default; at most {limit / 2**20:.0f} MiB, =free for none): up to ")
        notes.append(f"{facts.name}: MIXPREC_MASTER_WORKSPACE{how}{kept / 2**20:,.1f} MiB of the step's temporaries (one bucket's) "
                     "stay allocated through forward and backward on a CPU; counted in the forward/backward peak")
    if shape is None:
        notes.append("no activations: give --batch --seq --d-model --layers --heads for a transformer estimate")
    if accumulate > 1:
        notes.append(f"accumulate={accumulate}: fp32 gradient accumulators through each window"
                     if accumulators else f"accumulate={accumulate}: gradients accumulate in place (no extra memory)")
    if parallel == "ddp":
        notes.append(f"ddp, {world_size} ranks: per rank, every rank holds all of it (DDP's gradient buckets are "
                     "the gradients)")
    return Plan(facts.name, optimizer.lower(), counts, b, persistent, fwd_bwd, step,
                persistent + max(fwd_bwd, step), tuple(notes), world_size, parallel)


def facts_from_recipe(recipe: Any, device_type: str = "cpu") -> StorageFacts:
    """``StorageFacts`` for a ``mixprec.Recipe`` on ``device_type`` (imports torch: the recipe
    already did). The device matters for autocast's op lists: on CUDA softmax runs in fp32."""
    from mixprec.distributed.fsdp import unsupported
    from mixprec.formats import get_format
    from mixprec.masters import STRATEGIES
    from mixprec.masters.buckets import BUCKET_NUMEL

    param_bytes = get_format(recipe.policy.param_dtype).bytes
    compute_bytes = get_format(recipe.policy.compute_dtype).bytes
    strategy = STRATEGIES.get(recipe.master)
    return StorageFacts(
        name=recipe.name,
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        master_bytes=strategy.extra_bytes if strategy else 0,
        step_bytes=strategy.step_bytes if strategy else 0,
        step_value_bytes=strategy.value_bytes if strategy else 0,
        defers_grads=bool(strategy),  # a loss scaler checks the 16-bit gradients where they wait
        step_temp_bytes=strategy.temp_bytes if strategy else 0,
        bucket_numel=BUCKET_NUMEL if strategy else 0,
        autocast=bool(recipe.autocast),
        fp8=getattr(recipe, "fp8", None) is not None,
        # a pure recipe without islands (fp16-pure) runs the residual stream and the norms in 16 bits
        norm_bytes=compute_bytes if recipe.pure and not recipe.fp32_modules else 4,
        prob_bytes=4 + compute_bytes if device_type == "cuda" and recipe.autocast and compute_bytes < 4 else None,
        fsdp_refused=unsupported(recipe),
        kept_bytes=strategy.kept_bytes if strategy and device_type == "cpu" else 0,  # (CUDA's allocator keeps them)
    )


#: No model has 10**15 parameters; past it the arithmetic (and the user's intent) is gone.
MAX_COUNT = 10**15


def parse_count(text: str, minimum: int = 0) -> int:
    """``"7e9"``, ``"7B"``, ``"6.7B"``, ``"125M"``, ``"1_000"`` -> an int (read in decimal, so
    ``6.7B`` is exactly 6,700,000,000; a fraction of a parameter is refused). Counts below
    ``minimum`` or above ``MAX_COUNT`` are refused."""
    import decimal

    t = text.strip().replace("_", "").replace(",", "")
    mult = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(t[-1:].lower(), 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = decimal.Decimal(t) * mult
    except decimal.InvalidOperation:
        raise ValueError(f"cannot read a parameter count from {text!r}; write e.g. 7e9, 7B, 125M or 1000") from None
    if not value.is_finite() or value < minimum:
        raise ValueError(f"a parameter count must be >= {minimum}, got {text!r}")
    if value > MAX_COUNT:
        raise ValueError(f"a parameter count of {text!r} is more than {MAX_COUNT:.0e}: no model is that large "
                         "(write e.g. 7e9 or 7B)")
    if value != value.to_integral_value():
        raise ValueError(f"a parameter count is a whole number, got {text!r} ({value.normalize()})")
    return int(value)


def _fsdp_plan(counts: ParamCounts, facts: StorageFacts, optimizer: str, shape: TransformerShape | None,
               accumulate: int, world: int) -> Plan:
    """Per rank under FSDP2 (see the module docstring): fp32 shards of everything that persists."""
    n, t = counts.total, counts.trainable

    def shard(count: int) -> int:
        return -(-count // world)  # ceil: the planner does not know the rows to pad

    compute_16 = facts.compute_bytes < 4
    n16 = n - counts.fp32_kept if facts.stores_16bit else (counts.matmul_weights if counts.matmul_weights is not None
                                                            else n)
    b = {
        "weights": shard(n) * 4,
        "masters": 0,
        "optimizer state": shard(t) * optimizer_state_bytes(optimizer),
        "gradients": shard(t) * 4,
        "fp32 grad accumulators": t * 4 if accumulate > 1 else 0,
        "autocast weight copies": n16 * facts.compute_bytes if compute_16 else 0,
        "activations": activation_bytes(shape, facts) if shape is not None else 0,
        "step-time fp32": 0,
    }
    persistent = b["weights"] + b["optimizer state"]
    logits_grad = shape.batch * shape.seq * shape.vocab * 4 if shape is not None else 0
    fwd_bwd = b["gradients"] + b["fp32 grad accumulators"] + b["autocast weight copies"] + b["activations"] + logits_grad
    step = b["gradients"]
    notes = [f"fsdp, {world} ranks: per rank; weights, gradients and optimizer state sharded (fp32)"
             + ("; the sharded fp32 weights are the masters" if facts.stores_16bit else ""),
             "compute copies (all-gathered 16-bit parameters) counted as if every one were gathered at once "
             "(reshard_after_forward=False): an upper bound; resharding, FSDP2 holds one or two units of them"
             if compute_16 else "fp32 compute: FSDP2 gathers the fp32 parameters of one unit at a time"]
    if shape is None:
        notes.append("no activations: give --batch --seq --d-model --layers --heads for a transformer estimate")
    if accumulate > 1:
        notes.append(f"accumulate={accumulate}: FSDP2 keeps unsharded fp32 gradients through each window")
    return Plan(facts.name, optimizer.lower(), counts, b, persistent, fwd_bwd, step,
                persistent + max(fwd_bwd, step), tuple(notes), world, "fsdp")
