"""Recipes: the one place that knows recipe names.

A recipe is more than an autocast dtype: it is a ``Policy`` (param / compute / output dtypes), the
kind of loss scaler, whether compute goes through ``torch.autocast``, and which modules stay in
fp32. ``resolve_recipe`` turns a name (or a jmp policy string) into a ``Recipe``; ``"auto"`` looks
at the device and says why it chose what it chose.

>>> r = resolve_recipe("fp16-mixed", "cpu")
>>> (str(r.policy), r.loss_scaling)
('p=f32,c=f16,o=f32', 'dynamic')
>>> resolve_recipe("p=f32,c=bf16,o=f32", "cpu").name
'p=f32,c=bf16,o=f32'
>>> resolve_recipe("p=bf16,c=bf16,o=f32", "cpu").master  # 16-bit storage always comes with masters
'fp32'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch

from mixprec.formats import get_format
from mixprec.policy import Policy, get_policy

LossScaling = Literal["none", "static", "dynamic"]

#: Module families kept in fp32 by the mixed recipes. Names, not classes, so a recipe stays a
#: plain frozen value; ``islands.module_matches_rule`` turns them into isinstance checks.
NORMS = "norms"

#: How parameters stored in 16 bits are trained (``mixprec.masters``): "none" means parameters
#: are stored in fp32 and the optimizer steps them directly.
MASTER_KINDS = ("none", "fp32", "kahan", "sr", "remainder", "nearest")
#: Parameters the 16-bit storage recipes keep in fp32 (rule items of ``mixprec.masters.rules``).
FP32_PARAMS = ("norms", "biases", "embeddings", "bare")

@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """What an fp8 recipe swaps into the model and how it scales (``mixprec.fp8``; docs/fp8.md).

    ``scaling``: "delayed" (Transformer Engine's DelayedScaling: a step's scale from the amax history
    up to the step before; ``amax_history_len``, ``amax_compute_algo`` and ``margin`` as TE's, with its
    defaults), "current" (torchao's: from the tensor being cast; ``granularity`` "rowwise" for a
    scale per row) or "none" (scale 1: the unsafe baseline). ``format``: "hybrid" (e4m3 inputs and
    weights, e5m2 output gradients) or "e4m3". ``pow2_scales``: scales rounded down to powers of two.
    Which layers: ``skip_first_last`` (the first and last ``nn.Linear`` stay bf16, torchao's advice),
    ``exclude`` (glob patterns). ``gemm``: "auto" (``torch._scaled_mm`` on CUDA sm89+, else the exact
    emulation), "emulate" or "scaled_mm".
    """

    scaling: str = "current"
    format: str = "hybrid"
    granularity: str = "tensorwise"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    reduce_amax: bool = True  # delayed: all-reduce the amaxes over the data-parallel ranks each step (TE's)
    pow2_scales: bool = False
    skip_first_last: bool = True
    exclude: tuple[str, ...] = ()
    gemm: str = "auto"
    cache_weight: bool = True  # reuse a weight's fp8 cast across the micro-batches of a window (bitwise the same)

    def __post_init__(self) -> None:
        from mixprec.fp8.options import check_spec  # every field's type and range (a capability's own rules)

        check_spec(self)
        object.__setattr__(self, "exclude", tuple(self.exclude))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a mixed-precision recipe does, as data.

    Attributes:
        name: the canonical name (``bf16-mixed``), or the policy string for jmp-style recipes.
        policy: param / compute / output dtypes.
        loss_scaling: ``"dynamic"`` (``GradScaler``), ``"static"`` (``StaticLossScaler``) or ``"none"``.
        autocast: run the forward under ``torch.autocast(compute_dtype)``; parameters stay in
            ``param_dtype`` and ops are cast at call time.
        fp32_modules: module families (``"norms"``) or class names that run as fp32 islands.
        static_scale: the scale used when ``loss_scaling == "static"``.
        master: for parameters stored in 16 bits, what keeps their updates from vanishing:
            ``"fp32"`` (an fp32 master copy), ``"kahan"`` (16-bit compensation), ``"sr"``
            (stochastic rounding), ``"remainder"`` (int16 remainders, an exact fp32 master) or
            ``"nearest"`` (nothing: the unsafe baseline). ``"none"`` for fp32 storage.
        fp32_params: with 16-bit storage, the parameters that stay fp32 (``mixprec.masters.rules``).
        pure: the whole model in the 16-bit storage dtype, as ``model.half()`` and Apex O3 make it:
            floating buffers (BatchNorm's running statistics) are stored in it too, and the
            model's floating inputs are cast to it. Needs 16-bit storage and ``fp32_params=()``.
        fp8: for fp8 recipes, which ``nn.Linear`` layers compute in fp8 and how they scale
            (``Fp8Spec``; ``prepare`` swaps them, ``mixprec.fp8``); None for the others.
        description: one line for ``mixprec recipes``.
        reason: why this recipe was chosen (``auto`` fills it in; otherwise "requested").
        attention: "recipe", "fp32" or "fastest": how 16-bit autocast runs the attention product (``mixprec.attention``).
    """

    name: str
    policy: Policy
    loss_scaling: LossScaling = "none"
    autocast: bool = False
    fp32_modules: tuple[str, ...] = ()
    static_scale: float = 2.0**16
    description: str = ""
    reason: str = "requested"
    master: str = "none"
    fp32_params: tuple = ()
    pure: bool = False
    fp8: Fp8Spec | None = None
    attention: str = "recipe"

    def __post_init__(self) -> None:
        if self.loss_scaling not in ("none", "static", "dynamic"):
            raise ValueError(
                f"Recipe {self.name!r}: loss_scaling={self.loss_scaling!r}; expected 'none', 'static' or 'dynamic'"
            )
        self._check_master()
        from mixprec.attention import check_mode  # ("recipe", "fp32", "fastest")
        check_mode(self.attention)
        if self.pure and (self.policy.param_dtype == _F32 or self.fp32_params):
            raise ValueError(
                f"Recipe {self.name!r}: pure=True puts the whole model in 16 bits; it needs 16-bit parameters "
                "and fp32_params=()"
            )
        if self.fp8 is not None and (not isinstance(self.fp8, Fp8Spec) or self.policy.param_dtype != _F32):
            raise ValueError(f"Recipe {self.name!r}: fp8 takes an Fp8Spec, and fp8 recipes keep fp32 parameters "
                             "(the fp8 copies are made per step)")

    def _check_master(self) -> None:
        if self.master not in MASTER_KINDS:
            raise ValueError(f"Recipe {self.name!r}: master={self.master!r}; expected one of {', '.join(MASTER_KINDS)}")
        stored = get_format(self.policy.param_dtype)
        if stored.dtype == _F32:
            if self.master != "none":
                raise ValueError(
                    f"Recipe {self.name!r} stores parameters in f32, so master={self.master!r} has nothing to "
                    "do; use master='none', or store parameters in bf16/f16"
                )
            return
        if not stored.is_16bit:
            raise ValueError(f"Recipe {self.name!r}: parameters can be stored in f32, bf16 or f16, not {stored.name}")
        if self.master == "none":
            raise ValueError(
                f"Recipe {self.name!r} stores parameters in {stored.name} without master weights: small "
                "updates would vanish. Choose master='fp32' (or 'kahan', 'sr', 'remainder'; 'nearest' to "
                "opt into the unsafe baseline)"
            )
        if self.master in ("sr", "remainder") and stored.dtype != torch.bfloat16:
            raise ValueError(
                f"Recipe {self.name!r}: master={self.master!r} works on bf16 storage (bf16 is the top half "
                f"of fp32), not {stored.name}; use master='fp32' or 'kahan'"
            )
        if self.policy.compute_dtype != stored.dtype:
            raise ValueError(
                f"Recipe {self.name!r} stores parameters in {stored.name} but computes in "
                f"{get_format(self.policy.compute_dtype).name}; with 16-bit storage the compute dtype must "
                "be the storage dtype (the weights are used as stored)"
            )

    @property
    def stores_16bit(self) -> bool:  # parameters live in 16 bits and ``master`` keeps their updates
        return self.master != "none"

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def unsafe(self) -> bool:  # a demonstration baseline, which fails by design: run when named, never in "all"
        return self.master == "nearest" or (self.fp8 is not None and self.fp8.scaling == "none")

    @property
    def is_mixed(self) -> bool:
        """True when some compute runs in fewer bits than the parameters are stored in."""
        return get_format(self.policy.compute_dtype).bits < get_format(self.policy.param_dtype).bits


_F32 = torch.float32

# canonical name -> recipe; alias -> canonical name
_REGISTRY: dict[str, Recipe] = {}
_ALIASES: dict[str, str] = {}
_DISPLAY_ALIASES: dict[str, tuple[str, ...]] = {}  # canonical (lower) -> aliases as registered


def register_recipe(recipe: Recipe, aliases: tuple[str, ...] = (), *, overwrite: bool = False) -> Recipe:
    """Add a recipe (and its aliases) to the registry. Names are matched case-insensitively."""
    names = [recipe.name, *aliases]
    for n in names:
        key = n.lower()
        if not overwrite and (key in _ALIASES or key == "auto"):
            raise ValueError(f"recipe name {n!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[recipe.name.lower()] = recipe
    _DISPLAY_ALIASES[recipe.name.lower()] = tuple(aliases)
    for n in names:
        _ALIASES[n.lower()] = recipe.name.lower()
    return recipe


register_recipe(
    Recipe("fp32", Policy(_F32, _F32, _F32), description="full fp32: the reference every recipe is judged against"),
    aliases=("32-true", "32", "O0", "f32", "float32"),
)
register_recipe(
    Recipe(
        "bf16-mixed",
        Policy(_F32, torch.bfloat16, _F32),
        autocast=True,
        fp32_modules=(NORMS,),
        description="bf16 autocast, fp32 weights/optimizer/loss, norms in fp32, no loss scaling",
    ),
    aliases=("bf16",),
)
register_recipe(
    Recipe(
        "fp16-mixed",
        Policy(_F32, torch.float16, _F32),
        loss_scaling="dynamic",
        autocast=True,
        fp32_modules=(NORMS,),
        description="fp16 autocast with dynamic loss scaling, fp32 weights/optimizer/loss, norms in fp32",
    ),
    aliases=("16-mixed", "16", "fp16", "O1"),
)


def _storage_recipe(name: str, dtype: torch.dtype, master: str, description: str) -> Recipe:
    """A 16-bit storage recipe: weights and grads in ``dtype``, autocast for the ops that must stay
    fp32 and for mixing with the fp32 parameters, fp32 output."""
    return Recipe(
        name,
        Policy(dtype, dtype, _F32),
        loss_scaling="dynamic" if dtype == torch.float16 else "none",
        autocast=True,
        fp32_modules=(NORMS,),
        master=master,
        fp32_params=FP32_PARAMS,
        description=description,
    )


for _name, _dtype, _master, _aliases, _description in (
    ("bf16-true", torch.bfloat16, "fp32", (),
     "bf16 weights and grads, fp32 master copy and optimizer state; norms, biases, embeddings, bare params in fp32"),
    ("fp16-true", torch.float16, "fp32", ("O2",),
     "fp16 weights and grads, fp32 master copy and optimizer state, dynamic loss scaling (Apex O2)"),
    ("bf16-true-kahan", torch.bfloat16, "kahan", (),
     "bf16 weights with a bf16 Kahan compensation buffer instead of a master (2 B/param less)"),
    ("bf16-true-sr", torch.bfloat16, "sr", (),
     "bf16 weights, updates stochastically rounded (unbiased), no master (4 B/param less)"),
    ("bf16-true-remainder", torch.bfloat16, "remainder", (),
     "bf16 weights + int16 remainders: an exact fp32 master in 2 extra bytes (Megatron's trick)"),
    ("bf16-pure", torch.bfloat16, "nearest", (),
     "UNSAFE baseline: bf16 weights rounded to nearest after each step, no master: small updates vanish"),
):
    register_recipe(_storage_recipe(_name, _dtype, _master, _description), aliases=_aliases)

# Apex O3, "pure fp16": everything in fp16 (batchnorm too), no master weights, loss scale 1. A
# speed baseline, not a way to train: kept as Apex defined it so "O3" means what it meant there.
# (The only difference: the output is cast to fp32, so the loss is computed in fp32.)
register_recipe(
    Recipe(
        "fp16-pure",
        Policy(torch.float16, torch.float16, _F32),
        loss_scaling="none",
        autocast=True,
        master="nearest",
        fp32_params=(),
        pure=True,
        description="UNSAFE baseline (Apex O3): everything in fp16, norms too, no master, no loss scaling",
    ),
    aliases=("O3",),
)


# fp8 on top of bf16-mixed (fp32 weights and optimizer state, bf16 autocast elsewhere, norms fp32,
# no loss scaler): eligible nn.Linear layers compute in fp8 (prepare swaps them; mixprec.fp8).
# Current scaling is the recommended one ("fp8"): torchao dropped delayed scaling for accuracy.
for _name, _spec, _aliases, _description in (
    ("fp8-current", Fp8Spec("current"), ("fp8",),
     "fp8 linears, per-tensor current scaling (torchao tensorwise), e4m3 fwd / e5m2 grads; the rest bf16-mixed"),
    ("fp8-delayed", Fp8Spec("delayed"), (),
     "fp8 linears, delayed scaling from a 1024-step amax history (Transformer Engine); the rest bf16-mixed"),
    ("fp8-unscaled", Fp8Spec("none", format="e4m3", skip_first_last=False), (),
     "UNSAFE baseline: every linear in fp8, no scaling, e4m3 gradients: small gradients flush to zero"),
):
    register_recipe(
        Recipe(_name, Policy(_F32, torch.bfloat16, _F32), autocast=True, fp32_modules=(NORMS,), fp8=_spec,
               description=_description),
        aliases=_aliases,
    )


def list_recipes() -> list[Recipe]:
    """Registered recipes (``auto`` and policy strings are resolved, not listed)."""
    return list(_REGISTRY.values())


def recipe_aliases(recipe: Recipe | str) -> tuple[str, ...]:
    """The aliases a registered recipe answers to (as registered, e.g. ``("32-true", "32", "O0")``)."""
    name = recipe.name if isinstance(recipe, Recipe) else recipe
    return _DISPLAY_ALIASES.get(name.lower(), ())


def recipe_names() -> list[str]:
    """Every accepted name: canonical names, aliases and ``auto``."""
    return ["auto", *sorted(set(_ALIASES), key=str.lower)]


def get_recipe(name: str) -> Recipe:
    """A registered recipe by name or alias (``auto`` needs a device: use ``resolve_recipe``)."""
    if not isinstance(name, str):
        raise TypeError(f"expected a recipe name, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _ALIASES:
        return _REGISTRY[_ALIASES[key]]
    if key == "auto" or "=" in key:
        raise ValueError(
            f"get_recipe({name!r}) looks up registered recipes only; resolve_recipe({name!r}, device) "
            "also resolves 'auto' and jmp policy strings"
        )
    raise ValueError(_unknown_message(name))


def _did_you_mean(name: str) -> str:
    """`` Did you mean 'bf16-mixed'?`` for a near miss (``bf61-mixed``, ``bf16_mixed``), else ""."""
    import difflib

    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    candidates = sorted(set(_ALIASES) | {"auto"})
    if key in _ALIASES:
        return f" Did you mean {_ALIASES[key]!r}?"
    scored = sorted(((difflib.SequenceMatcher(None, key, c).ratio(), c) for c in candidates), reverse=True)
    best = scored[0][0] if scored else 0.0
    # the closest name, and another only when it is as close (bf61-mixed: bf16-mixed or fp16-mixed)
    names = list(dict.fromkeys(_ALIASES.get(c, c) for r, c in scored if r >= 0.75 and r >= best - 1e-9))
    return f" Did you mean {' or '.join(repr(n) for n in names)}?" if names else ""


def _unknown_message(name: str) -> str:
    canon = ", ".join(r.name for r in list_recipes())
    return (
        f"Unknown recipe {name!r}.{_did_you_mean(name)} Expected one of auto, {canon} (aliases: "
        f"{', '.join(a for a in sorted(_ALIASES) if a not in _REGISTRY)}), or a jmp policy string "
        "such as 'p=f32,c=bf16,o=f32'. Run 'mixprec recipes' to see them all."
    )


def _from_policy_string(text: str) -> Recipe:
    try:
        policy = get_policy(text)
    except ValueError:
        if "=" in text:
            raise
        # not a name and not a policy with keys: the policy parser's complaint would only confuse
        raise ValueError(_unknown_message(text)) from None
    if policy.param_dtype != _F32:
        stored = get_format(policy.param_dtype)
        if not stored.is_16bit or policy.compute_dtype != policy.param_dtype:
            raise ValueError(
                f"Policy {text!r} stores parameters in {stored.name} and computes in "
                f"{get_format(policy.compute_dtype).name}: 16-bit storage (with fp32 master weights) "
                "needs p=bf16,c=bf16 or p=f16,c=f16; or use p=f32 (autocast keeps fp32 weights)."
            )
        return dataclasses.replace(
            _storage_recipe(str(policy), policy.param_dtype, "fp32", f"jmp policy {policy}, fp32 master weights"),
            policy=policy,
        )
    compute = policy.compute_dtype
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"Policy {text!r} computes in {get_format(compute).name}; autocast compute must be f32, bf16 or f16"
        )
    mixed = compute != _F32
    return Recipe(
        name=str(policy),
        policy=policy,
        loss_scaling="dynamic" if compute == torch.float16 else "none",
        autocast=mixed,
        fp32_modules=(NORMS,) if mixed else (),
        description=f"jmp policy {policy}",
    )


@functools.lru_cache(maxsize=None)
def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU has native bf16 matmul (AVX512-BF16 or AMX), and what was found."""
    found = []
    for label, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                found.append(label)
        except Exception:  # private probes; absence means "unknown", treated as no
            pass
    if not found:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
            if "amx_bf16" in flags:
                found.append("AMX")
            if "avx512_bf16" in flags:
                found.append("AVX512-BF16")
        except OSError:
            pass
    capability = torch.backends.cpu.get_cpu_capability()
    if found:
        return True, f"this CPU has {' and '.join(found)} (torch CPU capability {capability})"
    return False, f"this CPU has neither AVX512-BF16 nor AMX (torch CPU capability {capability})"


def _auto(device: torch.device) -> Recipe:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"'auto' was asked for device {str(device)!r}, but CUDA is not available in this torch build "
                "or machine. Use device='cpu'."
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            why = f"{name} (sm_{major}{minor}) computes bf16 natively: bf16 needs no loss scaling"
            return dataclasses.replace(get_recipe("bf16-mixed"), reason=f"auto: {why}")
        why = f"{name} (sm_{major}{minor}) has no native bf16 (needs sm_80+): fp16 with dynamic loss scaling"
        return dataclasses.replace(get_recipe("fp16-mixed"), reason=f"auto: {why}")
    if device.type == "cpu":
        from mixprec.autotune import cpu_auto  # measured on this machine (once, then cached)
        return cpu_auto(get_recipe, cpu_bf16_support())
    return dataclasses.replace(
        get_recipe("fp32"), reason=f"auto: no mixed-precision rule for device type {device.type!r} yet"
    )


def as_device(device: str | torch.device | None) -> torch.device:
    """A torch.device; ``None`` means CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"Unknown device {device!r}: {e}. Use 'cpu', 'cuda' or 'cuda:N'.") from None


def check_device_can_run(recipe: Recipe, device: torch.device) -> None:
    """Raise a clear error when the device cannot run the recipe at all."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"Recipe {recipe.name!r} was asked for device {str(device)!r}, but CUDA is not available "
            "in this torch build or machine. Use device='cpu'."
        )
    if recipe.autocast and not torch.amp.is_autocast_available(device.type):
        raise RuntimeError(
            f"Recipe {recipe.name!r} needs torch.autocast on {device.type!r}, which this torch does not "
            "support. Use 'fp32' or another device."
        )
    if device.type == "cuda" and recipe.compute_dtype == torch.bfloat16:
        if not torch.cuda.is_bf16_supported(including_emulation=True):
            raise RuntimeError(
                f"Recipe {recipe.name!r} computes in bf16, which {torch.cuda.get_device_name(device)} cannot. "
                "Use 'fp16-mixed' (or 'auto')."
            )


def resolve_recipe(spec: str | Recipe, device: str | torch.device | None = None) -> Recipe:
    """Turn a recipe name, alias, ``auto`` or jmp policy string into a ``Recipe`` for ``device``.

    Raises ValueError for unknown names (listing what is accepted) and RuntimeError when the
    device cannot run the recipe.
    """
    dev = as_device(device)
    if isinstance(spec, Recipe):
        recipe = spec
    elif not isinstance(spec, str):
        raise TypeError(f"expected a recipe name or Recipe, got {type(spec).__name__}")
    elif spec.strip().lower() == "auto":
        recipe = _auto(dev)
    elif spec.strip().lower() in _ALIASES:
        recipe = get_recipe(spec)
    else:
        recipe = _from_policy_string(spec)
    check_device_can_run(recipe, dev)
    return recipe



def as_requested(recipe: Recipe, spec: Any) -> Recipe:
    """``recipe`` with a reason that names the alias it was asked for by ("fp8-current (requested as 'fp8')")."""
    asked = spec.strip() if isinstance(spec, str) else None
    if recipe.reason != "requested" or asked is None or asked.lower() == recipe.name.lower():
        return recipe
    return dataclasses.replace(recipe, reason=f"requested as {asked!r}")
