"""The memory planner and mixprec bench know the fp8 recipes."""

from __future__ import annotations

import pytest
import torch

from mixprec.bench.peak import peak_key, peak_keys
from mixprec.bench.runner import plan_variants, run_bench
from mixprec.bench.block import get_shape
from mixprec.memory import ParamCounts, TransformerShape, facts_from_recipe, plan
from mixprec.memory.measure import measure_step
from mixprec.recipes import get_recipe
from mixprec.tasks import load_task

CONFIG = dict(batch_size=4, seq_len=32, d_model=64, n_layer=2, n_head=4)
SHAPE = TransformerShape(batch=4, seq=32, d_model=64, layers=2, heads=4, vocab=96)
CPU = torch.device("cpu")


def test_fp8_weight_copies_cost_one_byte_per_parameter_not_two():
    counts = ParamCounts(7_000_000_000)
    bf16 = plan(counts, facts_from_recipe(get_recipe("bf16-mixed")))
    for name in ("fp8-current", "fp8-delayed"):
        p = plan(counts, facts_from_recipe(get_recipe(name)))
        assert p.per_param("autocast weight copies") == 1.0 and bf16.per_param("autocast weight copies") == 2.0
        assert p.persistent == bf16.persistent and p.peak == bf16.peak - 7_000_000_000
        assert any("every matmul weight computes in fp8" in n for n in p.notes)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_plan_matches_measured_bytes_of_one_fp8_step(recipe):
    # the built-in GPT: blocks.0.qkv (the first linear) and the head (the last) stay bf16, the rest fp8
    measured = measure_step(load_task(None, **CONFIG), recipe, "adamw", "cpu")
    p = plan(measured.counts, facts_from_recipe(get_recipe(recipe)), "adamw", SHAPE)
    d = 64
    fp8_weights = 2 * 12 * d * d - 3 * d * d  # both blocks' linears less block 0's qkv
    assert measured.counts.fp8_weights == fp8_weights
    assert measured.bytes["autocast weight copies"] == p.bytes["autocast weight copies"] == (
        fp8_weights + (3 * d * d + 96 * d) * 2)
    for comp in ("weights", "gradients", "masters", "step-time fp32"):
        assert measured.bytes[comp] == p.bytes[comp], comp
    # the fp8 linears save their inputs as fp8: the formula's fp8 term, within the usual 1%
    assert measured.bytes["activations"] == pytest.approx(p.bytes["activations"], rel=0.01)
    bf16 = plan(measured.counts, facts_from_recipe(get_recipe("bf16-mixed")), "adamw", SHAPE)
    assert p.bytes["activations"] < bf16.bytes["activations"]


def test_bench_runs_the_fp8_recipes_with_every_block_linear_in_fp8():
    assert {"fp8-current", "fp8-delayed", "fp8-unscaled"} <= {v.recipe for v in plan_variants(None, CPU)}
    doc = run_bench(get_shape("tiny"), CPU, plan_variants(["bf16-mixed", "fp8-current"], CPU), rounds=2, warmup=1,
                    peaks=False, memory=False)
    fp8 = next(r for r in doc["results"] if r["recipe"] == "fp8-current")
    assert fp8["status"] == "ok" and fp8["fp8_linears"] == "4 of 4 (emulate)"
    assert "fp8_linears" not in next(r for r in doc["results"] if r["recipe"] == "bf16-mixed")


def test_the_fp8_peak_is_measured_on_cuda_only_and_fp8_recipes_are_judged_by_it():
    assert "e4m3" in peak_keys(torch.device("cuda")) and "e4m3" not in peak_keys(CPU)
    assert peak_key(torch.bfloat16, False, torch.device("cuda"), fp8=True) == "e4m3"
    assert peak_key(torch.bfloat16, False, CPU) == "bf16"


@pytest.mark.slow
def test_the_gpu_scripts_fp8_parts_dry_run_on_cpu(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "NOCOMPILE": "1", "PARTS": "fp8", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu" / "run.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "run.log").read_text()
    for part in ("env", "fp8-cuda-tests", "fp8-linear", "fp8-block"):
        assert f"--- {part}: rc=0" in log
    assert {p.name for p in tmp_path.iterdir()} == {"run.log", "fp8_linear.json", "fp8_block.json", "summary.md"}
    summary = (tmp_path / "summary.md").read_text()
    assert "## fp8 on large linears" in summary and "fp8 GEMM over bf16 at 8192" in summary
