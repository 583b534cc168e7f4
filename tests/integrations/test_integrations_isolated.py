"""The frameworks stay out: importing mixprec (all of its modules but the integrations themselves),
the integrations package and its framework-free records module loads no framework."""

from __future__ import annotations

import subprocess
import sys

from mixprec_test_env import src_env

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "tensorboard", "wandb", "mlflow")

CODE = f"""
import importlib, pkgutil, sys
import mixprec
for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
    if info.name.startswith(("mixprec.integrations.", "mixprec.jax")) or info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
import mixprec.integrations, mixprec.integrations.records
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r})
print(loaded)
"""


def test_mixprec_and_the_records_import_no_framework():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=src_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
