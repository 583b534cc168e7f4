"""The public surface is what mixprec.__all__ lists: pinned here, and each name resolves."""

import doctest
import importlib
import importlib.util
import pkgutil
import subprocess
import sys

import pytest

import mixprec
from mixprec_test_env import src_env

CORE = {
    "FloatFormat", "get_format", "Policy", "get_policy", "Recipe", "get_recipe", "resolve_recipe",
    "list_recipes", "register_recipe", "GradScaler", "StaticLossScaler", "NoOpScaler", "ScaleFloorError",
    "fp32_island", "keep_fp32", "remove_fp32_islands", "Fp32LayerNorm", "Fp32GroupNorm", "Fp32RMSNorm",
    "MixedPrecision", "StepStats", "Task", "load_task", "__version__",
    "remove_fp8",  # undoes the fp8 recipes' module swap
}
CAPABILITIES = {"save_checkpoint", "load_checkpoint", "CheckpointError"}  # mixprec.distributed
TOOLS = {
    "compare", "ComparisonResult", "Verdict", "VerdictRule", "explain", "Explanation",
    "nan_guard", "NanGuard", "NonFiniteError", "NonFiniteWarning", "NonFiniteEvent",
    "probe_grad_underflow", "probe_update_vanishing", "probe_activation_range", "ScaleMonitor", "diagnose_scale",
    "doctor", "lint_paths", "lint_source",
}
# 0.1's top-level helpers, now in their submodules (importable from mixprec with a warning until 0.3)
MOVED = {
    "Fp32Island": "mixprec.islands", "island_names": "mixprec.islands", "RunResult": "mixprec.comparison",
    "MasterWeights": "mixprec.masters", "fp32_param_names": "mixprec.masters",
    "stochastic_round_bf16": "mixprec.masters", "kahan_add_": "mixprec.masters", "split_fp32": "mixprec.masters",
    "join_fp32": "mixprec.masters",
}


def test_public_names_are_exactly_the_pinned_ones_and_resolve():
    assert set(mixprec.__all__) == CORE | CAPABILITIES | TOOLS
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None, name
    assert sorted(mixprec.__all__[:-1]) == mixprec.__all__[:-1]


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_still_resolve_with_a_deprecation_warning_naming_their_new_home(name):
    with pytest.warns(DeprecationWarning, match=MOVED[name].replace(".", r"\.")):
        value = getattr(mixprec, name)
    assert value is getattr(importlib.import_module(MOVED[name]), name)
    assert name not in mixprec.__all__ and name not in dir(mixprec)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mixprec.nope  # noqa: B018


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=src_env()).stdout


def test_import_and_cli_help_do_not_load_torch():
    out = _run(
        "import sys, mixprec, mixprec.cli\n"
        "try:\n    mixprec.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    assert out.strip().endswith("NO-TORCH")


# modules that need an optional extra: their doctests run where the extra is installed (CI job 4)
NEEDS_EXTRA = {
    "mixprec.integrations.lightning": ("lightning",),
    "mixprec.integrations.fabric": ("lightning",),
    "mixprec.integrations.transformers": ("transformers", "accelerate"),
}


def _modules():
    for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
        if info.name.startswith("mixprec.jax") or info.name == "mixprec.__main__":
            continue
        yield info.name


def test_every_module_that_refuses_to_import_without_an_extra_is_listed():
    # a module importable only with an extra is named in NEEDS_EXTRA (so that a torch-only
    # install skips it, rather than failing) and nothing else is
    for name in NEEDS_EXTRA:
        assert name in set(_modules()), name
    source = {name: importlib.util.find_spec(name).origin for name in _modules()}
    for name, path in source.items():
        text = open(path, encoding="utf-8").read()
        if 'raise ImportError(f"mixprec.integrations' in text:
            assert name in NEEDS_EXTRA, name


@pytest.mark.parametrize("name", list(_modules()))
def test_docstring_examples_run(name):
    missing = [pkg for pkg in NEEDS_EXTRA.get(name, ()) if importlib.util.find_spec(pkg) is None]
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)} (an optional extra)")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in {name}"
