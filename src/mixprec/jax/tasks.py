"""The task protocol of the JAX ``compare``, and its built-in task: a character-level MLP in pure JAX.

A JAX task factory, named as ``"package.module:function"``, returns a ``JaxTask``::

    def make_task() -> mixprec.jax.JaxTask:
        return JaxTask(
            name="my-mlp",
            init_params=lambda key: {"w": jax.random.normal(key, (8, 4)) * 0.1},  # fp32, from the seed's key
            get_batch=lambda step: (x[step], y[step]),      # the same batch for a step in every run
            apply=lambda params, x, recipe: x @ params["w"],  # params and x arrive in the compute dtype
            loss_fn=lambda out, y: jnp.mean((out - y) ** 2),  # out arrives in the output dtype (fp32)
        )

The runner does the casting: ``policy.cast_to_compute((params, inputs))`` before ``apply`` and
``policy.cast_to_output`` after, so one ``apply`` serves every recipe; ``recipe.fp32_norms`` tells
a forward that the recipe keeps normalisations in fp32. Shapes are noted ``(B, T, D)``: batch,
context, channels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixprec.jax.recipes import JaxRecipe
from mixprec.tasks import TaskError, call_factory


def _default_optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=0.0)


@dataclasses.dataclass
class JaxTask:
    """A model, its data and its loss, as the JAX ``compare`` trains them.

    Attributes:
        name: shown in reports.
        init_params: ``key -> params``, an fp32 pytree; the key comes from the run's seed.
        get_batch: ``step -> (inputs, targets)``, host or device arrays; deterministic in ``step``.
        apply: ``(params, inputs, recipe) -> outputs``, traced under ``jit``.
        loss_fn: ``(outputs, targets) -> scalar loss``.
        make_optimizer: ``() -> optax.GradientTransformation`` (default AdamW, lr 1e-3).
        steps: default number of optimizer steps for a comparison.
        max_grad_norm: clip the unscaled gradients at this global norm (None: no clipping).
        description: one line for reports.
    """

    name: str
    init_params: Callable[[jax.Array], Any]
    get_batch: Callable[[int], tuple[Any, Any]]
    apply: Callable[[Any, Any, JaxRecipe], Any]
    loss_fn: Callable[[Any, Any], jax.Array]
    make_optimizer: Callable[[], optax.GradientTransformation] = _default_optimizer
    steps: int = 200
    max_grad_norm: float | None = 1.0
    description: str = ""


BUILTIN = "mixprec.jax.tasks:make_task"


def load_jax_task(spec: str | JaxTask | Callable[..., JaxTask] | None = None, **kwargs: Any) -> JaxTask:
    """Resolve a JAX task: None (the built-in char MLP), a ``JaxTask``, a factory or ``"module:function"``."""
    if isinstance(spec, JaxTask):
        if kwargs:
            raise TaskError("task arguments go to a task factory; a ready JaxTask takes none (pass its factory instead)")
        return spec
    if spec is None:
        spec = BUILTIN
    if isinstance(spec, str) and ":" not in spec:
        from mixprec.tasks import BUILTINS

        if spec.strip().lower() in BUILTINS:
            raise TaskError(
                f"task {spec!r} is a built-in torch task and has no JAX version; with --backend jax, leave --task out "
                "for the built-in JAX char MLP, or name a factory returning a mixprec.jax.JaxTask ('package.module:function')"
            )
        raise TaskError(f"JAX task {spec!r} must name a factory as 'package.module:function' returning a "
                        "mixprec.jax.JaxTask (or leave --task out for the built-in JAX char MLP)")
    task, label = call_factory(spec, kwargs, "a JAX task", "a JaxTask", explain_errors=False)
    if not isinstance(task, JaxTask):
        raise TaskError(
            f"task factory {label} returned {type(task).__name__}; --backend jax needs a mixprec.jax.JaxTask "
            "(init_params, get_batch, apply, loss_fn); a torch Task runs with --backend torch"
        )
    for field in ("init_params", "get_batch", "apply", "loss_fn", "make_optimizer"):
        if not callable(getattr(task, field)):
            raise TaskError(f"JAX task {task.name!r} from {label}: {field} must be callable")
    if not isinstance(task.steps, int) or task.steps < 1:
        raise TaskError(f"JAX task {task.name!r} from {label}: steps must be a positive integer, got {task.steps!r}")
    return task


def check_jax_task(task: JaxTask) -> None:
    """Refuse tasks whose batches change with numpy's global seed: every run must see the same data."""
    state = np.random.get_state()
    try:
        draws = []
        for seed in (12345, 54321):
            np.random.seed(seed)
            draws.append([_batch(task, step) for step in (0, 1)])
    finally:
        np.random.set_state(state)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for x, y in zip(draws[0], draws[1])
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))
    )
    if not same:
        raise TaskError(
            f"JAX task {task.name!r}: get_batch(step) returned different batches under different global seeds. "
            "compare needs the same data in every run; draw batches from a generator seeded by the step, e.g. "
            "np.random.default_rng(1000 + step) or jax.random.fold_in(key, step)"
        )


def check_jax_seeds(task: JaxTask) -> None:
    """Refuse tasks whose initial parameters ignore the seed's key: the fp32 runs from other seeds would
    be identical to the reference, and the noise band would shrink to its floor without measuring anything."""
    try:
        a, b = (task.init_params(jax.random.PRNGKey(seed)) for seed in (0, 1))
    except Exception as e:
        raise TaskError(f"JAX task {task.name!r}: init_params failed: {type(e).__name__}: {e}") from e
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(leaves_a) == len(leaves_b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)):
        raise TaskError(
            f"JAX task {task.name!r}: init_params gave identical parameters for the keys of seeds 0 and 1, so the fp32 "
            "runs from other seeds would be identical too and there would be no seed-to-seed noise to judge against "
            "(the band would fall to its 1% floor). Draw the initial weights from the key, e.g. "
            "jax.random.normal(key, shape) * 0.1"
        )


def _batch(task: JaxTask, step: int) -> tuple[Any, Any]:
    batch = task.get_batch(step)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TaskError(
            f"JAX task {task.name!r}: get_batch({step}) returned {type(batch).__name__}; expected a pair (inputs, targets)"
        )
    return batch[0], batch[1]


# ---------------------------------------------------------------------------- the built-in task


def _layer_norm(h: jax.Array, p: dict[str, jax.Array], fp32: bool, eps: float = 1e-5) -> jax.Array:
    # the variance of 16-bit activations cancels badly: mixed recipes compute the statistics in fp32
    x = h.astype(jnp.float32) if fp32 else h
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(y.dtype) + p["bias"].astype(y.dtype)).astype(h.dtype)


def make_task(
    steps: int = 200,
    batch_size: int = 64,
    context: int = 16,
    d_embed: int = 16,
    d_hidden: int = 192,
    lr: float = 3e-3,
    data_seed: int = 1234,
) -> JaxTask:
    """The built-in JAX task: predict the next character from the previous ``context`` ones.

    The corpus and the 96-symbol vocabulary are the torch built-in task's (Python's own pydoc
    text, no download). An embedding, a hidden layer with LayerNorm and GELU, a residual GELU layer
    and a softmax over the vocabulary; the loss falls from ~4.8 to ~1.8 in the default 200 steps.
    Its three matmuls go through ``recipe.matmul``: under the fp8 recipes the middle one computes in
    fp8 (the first and the last stay bf16, the torch side's rule).
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("context", context), ("d_embed", d_embed),
                        ("d_hidden", d_hidden), ("data_seed", data_seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "data_seed" else 1):
            raise ValueError(f"JAX char MLP task: {name} must be a positive integer, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"JAX char MLP task: lr must be a number > 0, got {lr!r}")
    from mixprec.tasks.charlm import VOCAB, corpus

    data = corpus().numpy().astype(np.int32)
    vocab = len(VOCAB)

    def get_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(data_seed * 1_000_003 + step)
        starts = rng.integers(0, data.size - context - 1, size=batch_size)
        idx = starts[:, None] + np.arange(context)[None, :]  # (B, T)
        return data[idx], data[starts + context]             # (B, T) inputs, (B,) next characters

    shapes = {"embed": (vocab, d_embed), "hidden": (context * d_embed, d_hidden), "mid": (d_hidden, d_hidden),
              "out": (d_hidden, vocab)}
    sizes = [math.prod(v) for v in shapes.values()]

    def init_params(key: jax.Array) -> dict[str, Any]:
        # one draw for all weights, cut on the host: a single random kernel to compile, shared by every seed
        flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
        w = dict(zip(shapes, (c.reshape(shapes[k]) for k, c in zip(shapes, np.split(flat, np.cumsum(sizes)[:-1])))))
        zeros = lambda n: jnp.zeros((n,), jnp.float32)  # noqa: E731
        return {
            "embed": jnp.asarray(w["embed"] * 0.5),
            "hidden": {"kernel": jnp.asarray(w["hidden"] / math.sqrt(context * d_embed)), "bias": zeros(d_hidden)},
            "norm": {"scale": jnp.ones((d_hidden,), jnp.float32), "bias": zeros(d_hidden)},
            "mid": {"kernel": jnp.asarray(w["mid"] / math.sqrt(d_hidden)), "bias": zeros(d_hidden)},
            "out": {"kernel": jnp.asarray(w["out"] / math.sqrt(d_hidden)), "bias": zeros(vocab)},
        }

    def apply(params: dict[str, Any], x: jax.Array, recipe: JaxRecipe) -> jax.Array:
        # recipe.matmul is x @ w, from fp8 operands under an fp8 recipe (where the layer rules allow it:
        # the first and last dots stay bf16, so the middle one computes in fp8)
        e = params["embed"][x]                                   # (B, T, D)
        h = recipe.matmul(e.reshape(e.shape[0], -1), params["hidden"]["kernel"], name="hidden") + params["hidden"]["bias"]
        h = jax.nn.gelu(_layer_norm(h, params["norm"], recipe.fp32_norms))  # (B, H)
        h = h + jax.nn.gelu(recipe.matmul(h, params["mid"]["kernel"], name="mid") + params["mid"]["bias"])
        return recipe.matmul(h, params["out"]["kernel"], name="out") + params["out"]["bias"]  # (B, vocab)

    def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return JaxTask(
        name="charmlp-jax",
        init_params=init_params,
        get_batch=get_batch,
        apply=apply,
        loss_fn=loss_fn,
        make_optimizer=lambda: optax.adamw(lr, weight_decay=0.0),
        steps=steps,
        max_grad_norm=1.0,
        description=f"char MLP (JAX) T={context} D={d_embed} H={d_hidden} B={batch_size} on pydoc text",
    )
