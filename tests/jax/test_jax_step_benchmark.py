"""benchmarks/jax_step_overhead.py runs, reports every arm, and its HLO comparison says what BENCHMARKS.md claims:
against the hand-written step that keeps the same skip record, mixprec's program adds no fusion (only the scalar
constants of its selects, and for fp16 the guard that keeps the scale from growing into inf)."""

import json
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "jax_step_overhead.py"


@pytest.mark.slow  # about 10 s: eight programs compiled twice each
def test_every_arm_is_timed_and_the_skip_record_compiles_like_the_hand_written_one(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--rounds", "2", "--steps", "2", "--dims", "8", "8", "4", "--batch", "4",
                                      "--bf16-unchecked", "--hand-count", "--json", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    printed = capsys.readouterr().out
    assert "against the hand-written step with the same skip record" in printed
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"bf16-mixed", "fp16-mixed"}
    for recipe, r in results.items():
        assert set(r["ms"]) >= {"mixprec", "hand", "hand+count"} and all(v > 0 for v in r["ms"].values())
        lo, hi = r["ratio_mixprec_over_hand_count"]["ci95"]
        assert 0 < lo <= r["ratio_mixprec_over_hand_count"]["median"] <= hi
        # The plain hand-written step lacks the record: mixprec has one fusion more than it ...
        assert r["hlo_extra"].get("fusion", 0) >= 1
        # ... and none more than the twin that keeps the same record.
        extra = r["hlo_extra_over_hand_count"]
        assert extra.get("fusion", 0) <= 0, (recipe, extra)
        assert r["hlo_instructions"]["hand+count"] > r["hlo_instructions"]["hand"]
    assert "ratio_mixprec_over_unchecked" in results["bf16-mixed"]


@pytest.mark.slow
def test_the_dispatch_benchmark_times_every_form_of_the_state(monkeypatch, capsys):
    script = SCRIPT.parent / "jax_dispatch.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--rounds", "2", "--calls", "2", "--recipes", "fp16-mixed"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    for form in ("mixprec's state", "as a tuple", "minimal Python node", "hand-written dict"):
        assert form in out
    assert out.count("16 leaves") == 4  # every form holds the same leaves
