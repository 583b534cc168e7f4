"""jmp's own test files (policy_test.py, loss_scale_test.py), unchanged, against mixprec.jax.

They are not vendored: they come from an installed jmp (its wheel ships them) or from the directory
named by ``MIXPREC_JMP_TESTS``, are copied byte for byte into a temporary directory, and run there by
pytest with ``jmp._src.policy`` / ``jmp._src.loss_scale`` aliased to ``mixprec.jax.policy`` /
``mixprec.jax.loss_scale``. Skipped when neither source is present, or without absl-py (their
test framework).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("absl.testing.parameterized", reason="jmp's tests are written with absl-py")

FILES = ("policy_test.py", "loss_scale_test.py")


def _source_dir() -> Path | None:
    env = os.environ.get("MIXPREC_JMP_TESTS")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("jmp")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "_src"


def test_jmp_test_files_pass_against_mixprec_jax(tmp_path):
    src = _source_dir()
    if src is None or not all((src / f).is_file() for f in FILES):
        pytest.skip("jmp's test files not found: install jmp in a throwaway venv or set MIXPREC_JMP_TESTS=<dir>")
    for f in FILES:
        shutil.copyfile(src / f, tmp_path / f)
    from mixprec_test_env import src_env

    env = src_env()
    env["PYTHONPATH"] = str(Path(__file__).parent) + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "jmp_alias", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-o", "addopts=", "-W", "ignore::RuntimeWarning", *FILES],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
