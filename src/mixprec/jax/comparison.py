"""The JAX twin of ``mixprec compare``: the same plan, verdict rules and report, with JAX runs.

fp32 trains from seed 0 (the reference) and from seeds 1..N (the noise); every other recipe trains
from seed 0. The band, the verdicts (TRACKS / DIVERGES / NON-FINITE / UNJUDGED / ERROR) and the
files come from ``mixprec.comparison`` unchanged: only the runs differ. A run is one jitted step
per recipe (compiled once, shared by the seeds): the policy's casts around the task's forward,
the loss scaled by the state's loss scale, and ``skip_nonfinite`` around the task's optimizer,
which unscales, clips (``max_grad_norm``), checks, adjusts the scale and commits or skips.

Every step is compiled with XLA's excess precision off (``COMPILER_OPTIONS``, per computation: the
user's other jitted functions keep their flags). XLA's default keeps f32 intermediates where the
program says bf16 or f16 (on CPU, which computes 16-bit arithmetic in f32, a bf16 add's rounding
simply disappears), so a verdict would judge a precision the program never had on an accelerator
that stores its 16-bit values. The report says so (``device`` and the JSON's ``xla`` entry).

>>> result = compare(recipes=("bf16-mixed",), steps=30)  # doctest: +SKIP
>>> result.verdicts["bf16-mixed"].status  # doctest: +SKIP
'TRACKS'
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixprec.comparison.api import DEFAULT_RECIPES, MIN_NOISE_SEEDS, REFERENCE, REFERENCE_SEED, ComparisonResult, _fp32_failed
from mixprec.comparison.runner import ProgressFn, RunError, RunResult, Role
from mixprec.comparison.verdict import Band, Verdict, VerdictRule, fp32_band, judge
from mixprec.jax.optim import is_skip_nonfinite, loss_scale_of, skip_nonfinite
from mixprec.jax.policy import policy_label
from mixprec.jax.recipes import JaxRecipe, get_recipe
from mixprec.jax.tasks import JaxTask, _batch, check_jax_seeds, check_jax_task, load_jax_task
from mixprec.tasks import TaskError

RunStartFn = Callable[[str, int, int], None]
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm  # optax.tree.norm from 0.2.5
StepFn = Callable[..., Any]
#: how compare compiles every step: each 16-bit value rounded as the program says (see the module docstring)
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


@dataclasses.dataclass
class JaxComparisonResult(ComparisonResult):
    """``ComparisonResult`` of JAX runs; its JSON says so (``backend``, jax versions, the XLA options), and
    for each fp8 recipe which dots of the forward computed in fp8 (``fp8_layers``)."""

    fp8_layers: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def machine(self) -> dict[str, Any]:
        """The host and jax's devices (no torch details: torch did not run)."""
        import datetime
        import platform
        import sys

        from mixprec.instruments.machine import cpu_features, cpu_name

        import jaxlib

        dev = jax.devices()[0]
        kind = getattr(dev, "device_kind", dev.platform)
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(), "device": self.device,
            "cpu": cpu_name(), "cpu_features": cpu_features(),
            "device_name": cpu_name() if dev.platform == "cpu" else kind, "backend": jax.default_backend(),
            "device_count": jax.device_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "command": " ".join(sys.argv),
        }

    def to_dict(self) -> dict[str, Any]:
        import jaxlib

        return {**super().to_dict(), "backend": "jax", "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "optax": optax.__version__, "xla": dict(COMPILER_OPTIONS), "fp8_layers": self.fp8_layers}


def resolve_device(device: str | None) -> Any:
    """A jax device from ``cpu``, ``gpu``, ``cuda``, ``tpu`` (optionally ``:N``); None: jax's default."""
    if device is None:
        return jax.devices()[0]
    name, _, index = device.partition(":")
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(name.lower(), name.lower())
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: jax has no {platform!r} backend here ({e}); jax sees {jax.devices()}") from None
    try:
        return devices[int(index) if index else 0]
    except (ValueError, IndexError):
        raise ValueError(f"device {device!r}: jax has {len(devices)} {platform} device(s)") from None


class Prepared(NamedTuple):
    """A recipe's step for a task: ``init(params)`` gives the carried state (the optimizer's, and the fp8
    dots' delayed-scaling state), ``step(params, state, x, y)`` trains one step. ``fp8_layers``: what the
    fp8 rules decided for each dot of the forward (empty for other recipes)."""

    tx: optax.GradientTransformation
    step: StepFn
    init: Callable[[Any], Any]
    fp8_layers: dict[str, str]


def _fp8_sites(task: JaxTask, recipe: JaxRecipe) -> dict[str, Any]:
    """Trace the forward once (shapes only) to list its dots, and decide each with the fp8 rules; refuse
    a forward in which none would compute in fp8 (the run would be bf16-mixed under the fp8 name)."""
    from mixprec.jax.fp8.binding import Binding, bind, decide, no_fp8_message

    binding = Binding()
    params = task.init_params(jax.random.PRNGKey(0))  # concrete: an init may draw on the host
    x, _ = _batch(task, 0)
    policy = recipe.policy
    jax.eval_shape(lambda p, xb: task.apply(*policy.cast_to_compute((p, xb)), bind(recipe, binding)), params, jnp.asarray(x))
    sites = decide(recipe, binding.seen)
    if not any(s.fp8 for s in sites.values()):
        raise TaskError(no_fp8_message(recipe, task.name, sites))
    return sites


def make_step(task: JaxTask, recipe: JaxRecipe) -> Prepared:
    """The optimizer (``skip_nonfinite`` around the task's, clip first) and the jitted training step."""
    policy = recipe.policy
    inner = task.make_optimizer()
    if is_skip_nonfinite(inner):
        raise TaskError(
            f"task {task.name!r}: make_optimizer returns a skip_nonfinite transformation, but compare wraps the task's "
            "optimizer in one for each recipe (with that recipe's loss scale): return the bare optimizer "
            "(e.g. optax.adamw(1e-3))"
        )
    if task.max_grad_norm is not None:
        inner = optax.chain(optax.clip_by_global_norm(task.max_grad_norm), inner)
    tx = skip_nonfinite(inner, recipe)
    sites = None if recipe.fp8 is None else _fp8_sites(task, recipe)

    def forward_recipe(fp8_state: Any) -> JaxRecipe:
        if sites is None:
            return recipe
        from mixprec.jax.fp8.binding import Binding, bind

        return bind(recipe, Binding(sites, fp8_state))

    def losses(params: Any, fp8_state: Any, x: Any, y: Any, loss_scale: Any) -> tuple[jax.Array, jax.Array]:
        params_c, x_c = policy.cast_to_compute((params, x))
        outputs = policy.cast_to_output(task.apply(params_c, x_c, forward_recipe(fp8_state)))
        loss = jnp.asarray(task.loss_fn(outputs, y), jnp.float32)
        return loss_scale.scale(loss), loss

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def step(params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any, tuple[jax.Array, ...]]:
        opt_state, fp8_state = state
        loss_scale = loss_scale_of(opt_state)
        (_, loss), (grads, fp8_grads) = jax.value_and_grad(losses, argnums=(0, 1), has_aux=True)(
            params, fp8_state, x, y, loss_scale)
        grad_norm = _global_norm(loss_scale.unscale(grads))  # before clipping, as the torch runner records it
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if fp8_state:
            from mixprec.jax.fp8 import update

            fp8_state = update(fp8_state, fp8_grads, opt_state)
        scale_used = jnp.asarray(loss_scale.loss_scale, jnp.float32)
        return new_params, (opt_state, fp8_state), (loss, grad_norm, scale_used, opt_state.last_skipped)

    def init(params: Any) -> Any:
        fp8_state: dict[str, Any] = {}
        if sites is not None and recipe.fp8.scaling == "delayed":
            from mixprec.jax.fp8 import Fp8Meta

            fp8_state = {name: Fp8Meta.init(recipe.fp8) for name, site in sites.items() if site.fp8}
        return tx.init(params), fp8_state

    layers: dict[str, str] = {}
    if sites is not None:
        from mixprec.jax.fp8.binding import describe

        layers = describe(sites)
    return Prepared(tx, step, init, layers)


def run_recipe(
    task: JaxTask,
    recipe: str | JaxRecipe,
    *,
    seed: int = 0,
    steps: int | None = None,
    device: Any = None,
    role: Role = "candidate",
    label: str | None = None,
    progress: ProgressFn | None = None,
    stop_after_nonfinite: int = 10,
    compiled: dict[str, Prepared] | None = None,
) -> RunResult:
    """Train ``task`` for ``steps`` steps under ``recipe`` from ``jax.random.PRNGKey(seed)``.

    ``compiled`` caches the jitted step per recipe across runs. Each step is waited for (one
    host sync per step) so that step times are real. Stops early after ``stop_after_nonfinite``
    non-finite losses in a row, as the torch runner does.
    """
    recipe = get_recipe(recipe)
    steps = task.steps if steps is None else int(steps)
    dev = resolve_device(device) if device is None or isinstance(device, str) else device
    label = label or (recipe.name if role != "noise" else f"{recipe.name} (seed {seed})")
    cache = compiled if compiled is not None else {}
    t_start = time.perf_counter()
    records: list[tuple[float, float, float, bool]] = []
    marks = [time.perf_counter()]
    stopped = error = None
    with jax.default_device(dev):
        if recipe.name not in cache:
            cache[recipe.name] = make_step(task, recipe)
        prepared = cache[recipe.name]
        step_fn = prepared.step
        try:
            params = recipe.prepare_params(task.init_params(jax.random.PRNGKey(seed)))
            opt_state = prepared.init(params)
        except Exception as e:
            raise TaskError(f"JAX task {task.name!r} under {recipe.name!r}: init failed: {type(e).__name__}: {e}") from e
        marks = [time.perf_counter()]
        for i in range(steps):
            try:
                x, y = _batch(task, i)
                params, opt_state, rec = step_fn(params, opt_state, jnp.asarray(x), jnp.asarray(y))
                loss, grad_norm, scale, skipped = (np.asarray(v) for v in rec)  # waits for the step
            except TaskError:
                raise
            except Exception as e:
                if role == "candidate":
                    error = RunError(label, i, e)
                    break
                if i == 0 and isinstance(e, (TypeError, ValueError)):
                    raise TaskError(f"JAX task {task.name!r}, step 0 under {recipe.name!r}: {type(e).__name__}: {e}") from None
                raise RunError(label, i, e) from e
            marks.append(time.perf_counter())
            records.append((float(loss), float(grad_norm), float(scale), bool(skipped)))
            if progress is not None:
                progress(label, i + 1, steps, loss)
            recent = [r[0] for r in records[-stop_after_nonfinite:]]
            if len(recent) == stop_after_nonfinite and not np.isfinite(recent).any():
                stopped = f"the loss was non-finite for {stop_after_nonfinite} steps in a row; stopped at step {i + 1}"
                break
    cols = [np.array(c) for c in zip(*records)] if records else [np.zeros(0)] * 4
    return RunResult(
        label=label,
        recipe=recipe.name,
        policy=policy_label(recipe.policy),
        loss_scaling=recipe.loss_scaling,
        seed=seed,
        role=role,
        loss=cols[0].astype(np.float64),
        grad_norm=cols[1].astype(np.float64),
        scale=cols[2].astype(np.float64),
        skipped=cols[3].astype(bool),
        step_time_s=np.diff(np.array(marks))[: len(records)],
        peak_memory_bytes=None,
        wall_s=time.perf_counter() - t_start,
        steps_requested=steps,
        stopped=stopped,
        error=None if error is None else str(error),
    )


def _resolve_all(recipes: Sequence[str | JaxRecipe]) -> list[JaxRecipe]:
    if isinstance(recipes, (str, JaxRecipe)):
        recipes = [recipes]
    resolved: list[JaxRecipe] = []
    asked: dict[str, str] = {}  # recipe name -> the first spelling that named it
    for spec in recipes:
        recipe = get_recipe(spec)
        first = asked.setdefault(recipe.name, spec if isinstance(spec, str) else recipe.name)
        if isinstance(spec, str) and spec != first:  # as the torch side says it: one recipe, one row
            warnings.warn(f"{first!r} and {spec!r} name the same recipe ({recipe.name}): it runs once, in one row",
                          UserWarning, stacklevel=3)
        if all(r.name != recipe.name for r in resolved):
            resolved.append(recipe)
    if not resolved:
        raise ValueError("compare needs at least one recipe, e.g. recipes=('bf16-mixed',)")
    return resolved


def compare(
    task: str | JaxTask | Callable[..., JaxTask] | None = None,
    recipes: Sequence[str | JaxRecipe] = DEFAULT_RECIPES,
    *,
    steps: int | None = None,
    seeds: int = MIN_NOISE_SEEDS,
    device: str | None = None,
    out: str | None = None,
    rule: VerdictRule | None = None,
    task_kwargs: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    on_run: RunStartFn | None = None,
) -> JaxComparisonResult:
    """Train a JAX ``task`` under each recipe and fp32 from ``1 + seeds`` seeds; judge every recipe.

    The arguments, rules and result are ``mixprec.compare``'s (see there); ``task`` is a JAX task
    (``JaxTask``, a factory, ``"module:function"``, or None for the built-in char MLP) and
    ``device`` a jax platform (``cpu``, ``gpu``, ``tpu``).
    """
    t_start = time.perf_counter()
    if not isinstance(seeds, int) or seeds < MIN_NOISE_SEEDS:
        raise ValueError(
            f"seeds={seeds!r}: the noise band needs at least {MIN_NOISE_SEEDS} fp32 runs from other seeds "
            "(one gap is an anecdote, not a spread)"
        )
    if steps is not None and (not isinstance(steps, int) or steps < 2):
        raise ValueError(f"steps={steps!r}: need an integer >= 2")
    if out is not None:
        from mixprec.comparison.report import check_out_dir

        check_out_dir(out)
    dev = resolve_device(device)
    reference = get_recipe(REFERENCE)
    candidates = [r for r in _resolve_all(recipes) if r.name != reference.name]
    if not candidates:
        raise ValueError(
            f"recipes {list(recipes)!r} name only fp32, the reference every recipe is judged against; "
            "add a recipe to compare with it, e.g. 'bf16-mixed'"
        )
    the_task = load_jax_task(task, **(task_kwargs or {}))
    check_jax_task(the_task)
    check_jax_seeds(the_task)
    compiled: dict[str, Prepared] = {}
    with jax.default_device(dev):  # what an fp8 recipe computes is checked before any training
        for r in candidates:
            if r.fp8 is not None:
                compiled[r.name] = make_step(the_task, r)
    n_steps = the_task.steps if steps is None else steps
    rule = rule or VerdictRule()

    plan: list[tuple[JaxRecipe, int, Role]] = [(reference, REFERENCE_SEED, "reference")]
    plan += [(reference, REFERENCE_SEED + i, "noise") for i in range(1, seeds + 1)]
    plan += [(r, REFERENCE_SEED, "candidate") for r in candidates]
    runs: list[RunResult] = []
    verdicts: dict[str, Verdict] = {}
    band: Band | None = None
    for index, (recipe, seed, role) in enumerate(plan):
        label = recipe.name if role != "noise" else f"{recipe.name} (seed {seed})"
        if on_run is not None:
            on_run(label, index, len(plan))
        run = run_recipe(the_task, recipe, seed=seed, steps=n_steps, device=dev, role=role, label=label,
                         progress=progress, compiled=compiled)
        runs.append(run)
        if role != "candidate" and not np.isfinite(run.loss).all():
            why = _fp32_failed(run)
            verdicts = {r.name: Verdict(r.name, r.name, "UNJUDGED", why) for r in candidates}
            break
        if role == "noise" and seed == REFERENCE_SEED + seeds:
            band = fp32_band(runs[0].loss, [r.loss for r in runs[1:]], rule)
        if role == "candidate":
            assert band is not None
            verdicts[recipe.name] = judge(run, band)

    result = JaxComparisonResult(
        task=the_task.name, description=the_task.description, device=f"{dev.platform} (jax, XLA excess precision off)",
        steps=n_steps, runs=runs, verdicts=verdicts, band=band, rule=rule, wall_s=0.0, threads=0,
        fp8_layers={name: p.fp8_layers for name, p in compiled.items() if p.fp8_layers},
    )
    result.wall_s = time.perf_counter() - t_start
    if out is not None:
        from mixprec.comparison.report import write_report

        result.files = write_report(result, out)
    return result
