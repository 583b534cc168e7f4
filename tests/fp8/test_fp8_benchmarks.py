"""The fp8 benchmarks run as one command each (tiny dry runs; the recorded runs are in benchmarks/results)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec_test_env import src_env

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=src_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_weight_cache_benchmark_checks_bitwise_and_prints_its_table(tmp_path):
    out = tmp_path / "cache.json"
    r = _run("fp8_weight_cache.py", "--d", "32", "--tokens", "8", "--accumulate", "2", "--rounds", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| fp8-current |" in r.stdout and "on / off (median, 95% CI)" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["bitwise_same"] and {row["recipe"] for row in doc["rows"]} == {"fp8-current", "fp8-delayed"}


@pytest.mark.slow
def test_the_wire_benchmark_counts_a_quarter_of_the_fp8_weights_bytes(tmp_path):
    out = tmp_path / "wire.json"
    r = _run("fp8_wire.py", "--d-model", "32", "--layers", "2", "--seq", "16", "--steps", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    off, on = doc["ranks"][0]["gather8=False"], doc["ranks"][0]["gather8=True"]
    assert doc["bitwise_same"] and off["bytes_per_step"] - on["bytes_per_step"] == 3 * on["fp8_weight_elements_per_rank"] * 2
