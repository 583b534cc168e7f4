"""Goal checks and the GPU run's summary, on hand-made result documents."""

import importlib.util
import json
import os
import pathlib
import subprocess

import pytest

from mixprec.bench import goals

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _result(label, median, speedup=None, frac=None, mem=None, syncs=None):
    return {"label": label, "status": "ok", "error": None, "step_s": {"median": median}, "peak_key": "bf16",
            "peak_fraction": frac, "memory": mem or {}, "syncs_per_step": syncs,
            "speedup_vs_fp32": None if speedup is None else {"baseline": "fp32", "median": speedup, "q25": speedup,
                                                             "q75": speedup}}


def _doc(results, optimizer="AdamW(fused)"):
    return {"results": results, "settings": {"optimizer": optimizer}}


def test_speedup_goal_is_met_at_2_5x_and_missed_below():
    doc = _doc([_result("fp32", 1.0, 1.0), _result("bf16-mixed", 0.4, 2.5)])
    assert goals.speedup_goal(doc, "bf16-mixed")["met"] is True
    doc["results"][1]["speedup_vs_fp32"]["median"] = 2.4
    assert goals.speedup_goal(doc, "bf16-mixed")["met"] is False
    assert goals.speedup_goal(None, "bf16-mixed")["met"] is None


def test_activation_goal_prefers_the_cuda_allocator_over_saved_bytes():
    doc = _doc([_result("fp32", 1.0, mem={"cuda_forward_delta": 100, "saved_bytes": 100}),
                _result("bf16-mixed", 1.0, mem={"cuda_forward_delta": 55, "saved_bytes": 70})])
    row = goals.activation_goal(doc)
    assert row["met"] is True and "0.550x (CUDA allocator)" in row["measured"]
    for r in doc["results"]:
        r["memory"]["cuda_forward_delta"] = None
    row = goals.activation_goal(doc)
    assert row["met"] is False and "saved for backward" in row["measured"]


def test_sync_goal_counts_only_with_a_fused_optimizer():
    doc = _doc([_result("fp32", 1.0, syncs=0), _result("fp16-mixed", 1.0, syncs=0)])
    assert goals.sync_goal(doc)["met"] is True
    doc["results"][1]["syncs_per_step"] = 1
    assert goals.sync_goal(doc)["met"] is False
    assert goals.sync_goal(_doc(doc["results"], "AdamW(foreach)"))["met"] is None


@pytest.mark.parametrize("lo, hi, expected, word", [(0.99, 1.01, True, "met"), (1.03, 1.05, False, "MISSED"),
                                                    (0.95, 1.10, None, "within noise")])
def test_overhead_goal_is_judged_on_the_confidence_interval(lo, hi, expected, word):
    run = {"status": "ok", "recipe": "fp32", "optimizer": "AdamW(foreach)", "extra_us_per_step": 3.0,
           "ratio_iteration": {"median": (lo + hi) / 2, "q25": lo, "q75": hi, "ci95_low": lo, "ci95_high": hi}}
    [row] = goals.overhead_goals([{"shape": {"name": "small"}, "runs": [run]}])
    assert row["met"] is expected and goals.verdict(row) == word


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "benchmarks" / "gpu" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_reads_what_is_there_and_writes_summary_md(tmp_path):
    eager = {**_doc([_result("fp32", 0.01, 1.0, 0.3), _result("bf16-mixed", 0.004, 2.6, 0.4)]),
             "env": {"device_name": "H200", "torch": "2.11", "cuda": "13.0", "date": "today"},
             "shape": {"name": "ref", "d_model": 1024, "batch": 32, "seq": 512}, "flops": {"step": 1.3e12},
             "peaks": {}}
    (tmp_path / "bench_eager.json").write_text(json.dumps(eager))
    (tmp_path / "run.log").write_text("--- eager: rc=0 in 30s\n--- compile-more: skipped, 10s of 470s left\n")
    summary = _summary_module()
    assert summary.main([str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "eager rc=0 in 30s; compile-more skipped" in text
    assert "| bf16-mixed | 4 | 2.60 |" in text
    assert "| bf16-mixed speedup over fp32 (TF32 off) | >= 2.5x | 2.60x" in text


@pytest.mark.slow
def test_gpu_script_dry_run_on_cpu_finishes_every_part(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "NOCOMPILE": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "run.log").read_text()
    for part in ("env", "cuda-tests", "eager", "overhead", "overhead-ref", "masters-step"):
        assert f"--- {part}: rc=0" in log
    assert {p.name for p in tmp_path.iterdir()} == {"run.log", "bench_eager.json", "overhead.json",
                                                      "overhead_ref.json", "masters_step.json", "summary.md"}
    assert "## goals" in proc.stdout and "## master-weight step work" in proc.stdout
    assert "--budget-s" in log  # the bench parts plan for their time limit


def _stub_python(tmp_path, fail_on: str, real: str) -> str:
    """A 'python' for run.sh: the real one for the environment check and the summary, instant
    success for the CUDA tests and benchmarks, exit 3 for commands containing ``fail_on``."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *"{fail_on}"*) echo "stub: failing on purpose" >&2; exit 3;;
  *"-m pytest"*|*"-m mixprec bench"*|*masters_step.py*) exit 0;;
  *) exec {real} "$@";;
esac
""")
    stub.chmod(0o755)
    return str(stub)


def _run_gpu_script(tmp_path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "NOCOMPILE": "1", "OUT": str(tmp_path / "out"),
           "PYTHON": python}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_gpu_script_stops_at_once_with_exit_1_when_the_environment_is_broken(tmp_path):
    proc = _run_gpu_script(tmp_path, "false")  # no python at all
    assert proc.returncode == 1
    assert "nothing else can run" in proc.stderr
    assert "=== cuda-tests" not in (tmp_path / "out" / "run.log").read_text()


def test_gpu_script_runs_every_part_but_exits_1_and_names_the_part_that_failed(tmp_path):
    import sys

    proc = _run_gpu_script(tmp_path, _stub_python(tmp_path, "--overhead --shape tiny --recipes fp32", sys.executable))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / "out" / "run.log").read_text()
    assert "  overhead: FAILED rc=3" in log and "  overhead-ref: ok" in log and "  masters-step: ok" in log
    assert "!!! overhead FAILED" in proc.stderr
    ok = _run_gpu_script(tmp_path, _stub_python(tmp_path, "nothing-matches-this", sys.executable))
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert all(f"  {p}: ok" in (tmp_path / "out" / "run.log").read_text()
               for p in ("env", "cuda-tests", "eager", "overhead", "overhead-ref", "masters-step"))
