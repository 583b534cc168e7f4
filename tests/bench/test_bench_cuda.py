"""CUDA-only checks of the benchmark (run by benchmarks/gpu/run.sh on a GPU machine)."""

import pytest
import torch

from mixprec.bench import overhead
from mixprec.bench.block import SHAPES, make_batches
from mixprec.bench.runner import Trainer, Variant, run_bench

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _results(doc):
    return {r["label"]: r for r in doc["results"]}


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_step_with_fused_adamw_never_syncs(recipe):
    doc = run_bench(SHAPES["tiny"], CUDA, [Variant(recipe)], rounds=1, warmup=2, optimizer="fused",
                    peaks=False, memory=False)
    r = _results(doc)[recipe]
    assert r["status"] == "ok", r["error"]
    assert r["syncs_per_step"] == 0


def test_sync_counter_sees_the_unfused_scaler_reading_found_inf():
    doc = run_bench(SHAPES["tiny"], CUDA, [Variant("fp16-mixed")], rounds=1, warmup=2, optimizer="foreach",
                    peaks=False, memory=False)
    assert _results(doc)["fp16-mixed"]["syncs_per_step"] >= 1


def test_cuda_memory_and_tf32_variants_are_measured():
    variants = [Variant("fp32"), Variant("fp32", tf32=True), Variant("bf16-mixed")]
    doc = run_bench(SHAPES["small"], CUDA, variants, rounds=2, warmup=1, peak_n=1024)
    res = _results(doc)
    assert set(doc["peaks"]) == {"f32", "tf32", "bf16", "f16"}
    for r in res.values():
        assert r["status"] == "ok", r["error"]
        mem = r["memory"]
        assert mem["cuda_forward_delta"] > 0 and mem["forward_delta"] == mem["cuda_forward_delta"]
        assert mem["peak_step"] >= mem["persistent_bytes"] + mem["forward_delta"]
    assert res["fp32+tf32"]["peak_key"] == "tf32"
    assert res["bf16-mixed"]["memory"]["cuda_forward_delta"] < res["fp32"]["memory"]["cuda_forward_delta"]
    assert res["bf16-mixed"]["memory"]["saved_bytes"] < res["fp32"]["memory"]["saved_bytes"]


def test_cuda_step_peak_leaves_out_the_other_variants_models():
    shape = SHAPES["small"]
    batches = make_batches(shape, CUDA, count=1)
    alone = Trainer(Variant("fp32"), shape, CUDA, "fused", 1.0, batches)
    alone.step()
    first = alone.memory()["peak_step"]
    crowd = [Trainer(Variant("fp32"), shape, CUDA, "fused", 1.0, batches) for _ in range(3)]
    for t in crowd:
        t.step()
    # the allocator's rounding may differ a little; three more models would add 3x persistent
    assert abs(alone.memory()["peak_step"] - first) < 0.5 * alone.persistent_bytes()


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_overhead_arms_train_alike_on_cuda(optimizer):
    doc = overhead.run_overhead(SHAPES["tiny"], CUDA, "fp16-mixed", rounds=3, warmup=1, optimizer=optimizer)
    # Attention backward kernels may accumulate in a different order from run to run: close, not bitwise.
    assert doc["max_param_diff_vs_hand"] < 1e-3
    assert doc["ratio_iteration"]["median"] > 0
