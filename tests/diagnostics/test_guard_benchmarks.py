"""The guard's benchmarks (benchmarks/guard_overhead.py, guard_parts.py, guard_floor.py) run to the end and print
every row they promise. They reach into the tracer (guard_parts replaces parts of it), so a change to the tracer
can break them without any library test noticing: guard_parts' no-hooks variant did, when ``Tracer.adopt`` gained
an argument. Tiny settings; slow (each builds the tiny Hugging Face GPT-2, guard_parts once per variant)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from mixprec_test_env import src_env  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RATIO = r"\d+\.\d{3} \(\d+\.\d{3}-\d+\.\d{3}\)"  # a median with its interval


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], env=src_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_guard_parts_runs_every_variant():
    out = _run(str(BENCH / "guard_parts.py"), "--rounds", "2")
    for variant in ("as-is", "hook-body-empty", "no-grad-records", "no-screen", "no-hooks"):
        assert re.search(rf"^\| {variant} \| {RATIO} \| \d+\.\d\d \|$", out, re.M), (variant, out)


@pytest.mark.slow
def test_guard_overhead_and_floor_print_their_tables(tmp_path):
    out = _run(str(BENCH / "guard_overhead.py"), "--models", "gpt2", "--arms", "off", "every-step", "--rounds", "2",
               "--warmup", "1", "--json", str(tmp_path / "g.json"))
    assert re.search(r"^\| gpt2 \| .* \| \*\*\d+\.\d{3}\*\* \(\d+\.\d{3}-\d+\.\d{3}\) \|", out, re.M), out
    assert (tmp_path / "g.json").stat().st_size > 0
    out = _run(str(BENCH / "guard_floor.py"), "--rounds", "2", "--ops", "20")
    for arm in ("empty-mode", "module-hooks"):
        assert re.search(rf"^\| {arm} \| {RATIO} \|$", out, re.M), (arm, out)
    for tracer in ("none", "full", "no source lines", "no backward hooks", "neither"):
        assert re.search(rf"^\| {tracer} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), (tracer, out)
