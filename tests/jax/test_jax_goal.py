"""docs/jax.md's Flax NNX transformer, run as written on two host devices (a subprocess: XLA_FLAGS must be set
before jax starts): it trains (the loss falls, nothing skipped) and its audit is clean of undone casts and
16-bit collectives. Slow (~1 min on two busy cores, most of it XLA compiling)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")
pytest.importorskip("flax")

from test_jax_docs import _blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_docs_nnx_transformer_trains_on_two_devices_with_accumulation(tmp_path):
    from mixprec_test_env import src_env

    (block,) = _blocks(ROOT / "docs" / "jax.md", "python", marked=True)
    assert "every_k=2" in block and "shard_map" in block and "nnx" in block
    script = tmp_path / "goal.py"
    script.write_text("import jax\nassert jax.device_count() == 2, jax.devices()\n" + block)
    env = src_env()
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = proc.stdout.splitlines()[0]  # "loss 4.68 -> 2.56, skipped 0"
    before, after = (float(v) for v in first.split(",")[0].removeprefix("loss ").split(" -> "))
    assert after < before - 1.5 and first.endswith("skipped 0"), proc.stdout
    assert "compiled all-reduce in f32" in proc.stdout and "undone-cast" not in proc.stdout, proc.stdout
