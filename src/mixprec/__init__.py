"""mixprec: mixed-precision training for PyTorch that is correct by construction.

The public API is what ``__all__`` lists. Names are imported lazily (PEP 562) so that
``import mixprec`` and the command-line tool stay fast and ``mixprec lint`` never loads torch.

>>> import mixprec
>>> mixprec.get_policy("p=f32,c=bf16")
Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it. One table, pinned by tests/test_public_api.py.
_EXPORTS: dict[str, str] = {
    # formats
    "FloatFormat": "mixprec.formats",
    "get_format": "mixprec.formats",
    # policies and recipes
    "Policy": "mixprec.policy",
    "get_policy": "mixprec.policy",
    "Recipe": "mixprec.recipes",
    "get_recipe": "mixprec.recipes",
    "resolve_recipe": "mixprec.recipes",
    "list_recipes": "mixprec.recipes",
    "register_recipe": "mixprec.recipes",
    # loss scaling
    "GradScaler": "mixprec.scaling",
    "StaticLossScaler": "mixprec.scaling",
    "NoOpScaler": "mixprec.scaling",
    "ScaleFloorError": "mixprec.scaling",
    # fp32 islands
    "fp32_island": "mixprec.islands",
    "keep_fp32": "mixprec.islands",
    "remove_fp32_islands": "mixprec.islands",
    "Fp32LayerNorm": "mixprec.islands",
    "Fp32GroupNorm": "mixprec.islands",
    "Fp32RMSNorm": "mixprec.islands",
    # the training step
    "MixedPrecision": "mixprec.training",
    "StepStats": "mixprec.training",
    # fp8 (the fp8 recipes swap nn.Linear layers in prepare; this swaps them back)
    "remove_fp8": "mixprec.fp8.swap",
    # checkpoints of model, optimizer and mixprec's state through torch.distributed.checkpoint
    "save_checkpoint": "mixprec.distributed.checkpoint",
    "load_checkpoint": "mixprec.distributed.checkpoint",
    "CheckpointError": "mixprec.distributed.checkpoint",  # what both raise (an Exception, unlike DCP's)
    # tasks (the protocol compare and doctor train)
    "Task": "mixprec.tasks",
    "load_task": "mixprec.tasks",
    # compare
    "compare": "mixprec.comparison.api",
    "ComparisonResult": "mixprec.comparison.api",
    "Verdict": "mixprec.comparison.verdict",
    "VerdictRule": "mixprec.comparison.verdict",
    # compare --explain: why a recipe does not track, and a verified fix
    "explain": "mixprec.comparison.explain.api",
    "Explanation": "mixprec.comparison.explain.result",
    # diagnostics
    "nan_guard": "mixprec.diagnostics.guard",
    "NanGuard": "mixprec.diagnostics.guard",
    "NonFiniteError": "mixprec.diagnostics.events",
    "NonFiniteWarning": "mixprec.diagnostics.events",
    "NonFiniteEvent": "mixprec.diagnostics.events",
    "probe_grad_underflow": "mixprec.diagnostics.probes.gradients",
    "probe_update_vanishing": "mixprec.diagnostics.probes.updates",
    "probe_activation_range": "mixprec.diagnostics.probes.activations",
    "ScaleMonitor": "mixprec.diagnostics.scale_monitor",
    "diagnose_scale": "mixprec.diagnostics.scale_monitor",
    "doctor": "mixprec.diagnostics.doctor",
    # lint (reads text; never imports torch)
    "lint_paths": "mixprec.lint",
    "lint_source": "mixprec.lint",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Names that were public at the top level in 0.1 and now live only in their submodule (helpers a
# training loop never needs at the top). Still importable from here, with a DeprecationWarning,
# until 0.3.
_MOVED: dict[str, str] = {
    "Fp32Island": "mixprec.islands",
    "island_names": "mixprec.islands",
    "RunResult": "mixprec.comparison",
    "MasterWeights": "mixprec.masters",
    "fp32_param_names": "mixprec.masters",
    "stochastic_round_bf16": "mixprec.masters",
    "kahan_add_": "mixprec.masters",
    "split_fp32": "mixprec.masters",
    "join_fp32": "mixprec.masters",
}


def __getattr__(name: str) -> Any:
    moved = _MOVED.get(name)
    if moved is not None:
        warnings.warn(f"mixprec.{name} has moved: import it from {moved} (the top-level name goes in 0.3)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(moved), name)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup is a plain attribute read
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
