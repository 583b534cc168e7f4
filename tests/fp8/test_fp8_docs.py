"""docs/fp8.md says what the code does: its examples run, its limits are the code's, its measured
numbers are the ones in benchmarks/results, and the files it names exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "fp8.md").read_text()
FLAT = " ".join(DOC.split())
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_python_block_runs(index):
    assert len(BLOCKS) >= 2
    exec(compile(BLOCKS[index], f"docs/fp8.md block {index}", "exec"), {"__name__": "__doc_fp8__"})


def test_the_limits_the_doc_states_are_the_codes():
    from mixprec.diagnostics import fp8_watch
    from mixprec.diagnostics.probes import fp8 as probes
    from mixprec.fp8 import mx, options, swap

    assert f"`margin` from 0 to {options.max_margin()}" in FLAT
    assert f"at least {fp8_watch.SPIKE:g}x against the layer's own history, or at least {100 * fp8_watch.FRACTION:g}%" in FLAT
    assert f"window of {fp8_watch.WINDOW} guard steps" in FLAT and f"last {fp8_watch.HISTORY} steps" in FLAT
    assert f"at or past {100 * probes.FLUSH_ALARM:g}% flushed" in FLAT and f"at {100 * probes.FLUSH_WARN:g}% flushed" in FLAT
    assert f"blocks of {mx.BLOCK} elements" in FLAT and f"multiples of {swap.MX_MULTIPLE}" in FLAT


def test_the_measured_numbers_are_the_recorded_ones():
    wire = json.loads((ROOT / "benchmarks/results/fp8_wire_gloo.json").read_text())
    off, on = wire["ranks"][0]["gather8=False"], wire["ranks"][0]["gather8=True"]
    assert wire["bitwise_same"]
    assert f"sends {off['bytes_per_step'] / 1e6:.2f} MB per rank and step with fp32 gathers and " \
           f"{on['bytes_per_step'] / 1e6:.2f} MB with fp8 gathers" in FLAT
    cache = json.loads((ROOT / "benchmarks/results/fp8_weight_cache_cpu.json").read_text())
    lo, hi = sorted(r["on_over_off"]["median"] for r in cache["rows"])
    assert f"took {lo:.2f}-{hi:.2f}x the time" in FLAT


def test_the_files_the_doc_names_exist():
    named = re.findall(r"`?((?:benchmarks|tests)/[\w/.-]+\.py)", DOC)
    assert named
    for path in named:
        assert (ROOT / path).exists(), path
