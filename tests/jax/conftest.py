"""Shared by the JAX tests.

They skip with ``pytest.importorskip("jax.numpy")``, not ``"jax"``: pytest puts ``tests/`` on
``sys.path``, so without jax installed ``import jax`` finds this directory as a namespace package and
succeeds. (An installed jax, a regular package, always wins over it.)

``impl``: the bug tests run against mixprec.jax and, where jmp is installed (a throwaway venv; it is
never a dependency), against jmp itself, where each must fail: ``xfail(strict=True)`` turns a jmp
that passes into a failure, so "fails on jmp, passes here" is checked, not claimed.
"""

import importlib.util
import types

import pytest

HAVE_JMP = importlib.util.find_spec("jmp") is not None


def _modules(name: str) -> types.SimpleNamespace:
    if name == "mixprec":
        import mixprec.jax.loss_scale as loss_scale
        import mixprec.jax.policy as policy
    else:
        from jmp._src import loss_scale, policy  # the real jmp, where installed
    return types.SimpleNamespace(name=name, policy=policy, loss_scale=loss_scale)


IMPLS = [pytest.param("mixprec", id="mixprec")]
if HAVE_JMP:
    IMPLS.append(pytest.param("jmp", id="jmp", marks=pytest.mark.xfail(strict=True, reason="jmp's bug, fixed in mixprec.jax")))


@pytest.fixture(params=IMPLS)
def impl(request):
    """The implementation under a bug test: mixprec.jax, and jmp (expected to fail) when installed."""
    pytest.importorskip("jax.numpy")
    return _modules(request.param)


def _fast_xla_compiles() -> None:
    """Compile with XLA's backend optimisation off for these tests.

    Compile time dominates them: a small training step takes ~5 s to compile at the default level
    on a busy 2-core machine and ~1.5 s at level 0. The tests check behaviour, and bit-for-bit
    identity of one computation done two ways within one configuration; the default level is checked
    by running the directory with MIXPREC_JAX_TEST_XLA_DEFAULT=1. Set here, before any test module
    imports jax (nothing collected earlier imports it).
    """
    import os

    if os.environ.get("MIXPREC_JAX_TEST_XLA_DEFAULT"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


_fast_xla_compiles()
