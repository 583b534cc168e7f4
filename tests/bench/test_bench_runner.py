"""The recipe benchmark: which variants run, and the JSON it returns."""

import dataclasses

import pytest
import torch

from mixprec import recipes
from mixprec.bench import runner
from mixprec.bench.block import SHAPES
from mixprec.bench.runner import Variant, plan_variants, run_bench

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_plan_runs_every_registered_recipe_once_on_cpu():
    labels = [v.label for v in plan_variants(None, CPU)]
    assert labels == [r.name for r in recipes.list_recipes()]


def test_plan_picks_up_a_recipe_registered_later(monkeypatch):
    monkeypatch.setattr(recipes, "_REGISTRY", dict(recipes._REGISTRY))
    monkeypatch.setattr(recipes, "_ALIASES", dict(recipes._ALIASES))
    monkeypatch.setattr(recipes, "_DISPLAY_ALIASES", dict(recipes._DISPLAY_ALIASES))
    recipes.register_recipe(dataclasses.replace(recipes.get_recipe("bf16-mixed"), name="bench-test-recipe"))
    assert "bench-test-recipe" in [v.label for v in plan_variants(None, CPU)]


def test_plan_doubles_fp32_compute_with_tf32_on_cuda_only(monkeypatch):
    monkeypatch.setattr(recipes, "check_device_can_run", lambda recipe, device: None)  # plan for CUDA without one
    cuda = [v.label for v in plan_variants(["fp32", "bf16-mixed"], CUDA, "both")]
    assert cuda == ["fp32", "fp32+tf32", "bf16-mixed"]
    assert [v.label for v in plan_variants(["fp32"], CPU, "both")] == ["fp32"]
    assert [v.label for v in plan_variants(["fp32", "bf16"], CUDA, "on")] == ["fp32+tf32", "bf16-mixed+tf32"]


def test_plan_compile_both_runs_eager_then_compiled_and_dedups_aliases():
    labels = [v.label for v in plan_variants(["fp32", "32-true", "bf16"], CPU, compile_mode="both")]
    assert labels == ["fp32", "bf16-mixed", "fp32+compile", "bf16-mixed+compile"]


def test_plan_accepts_a_jmp_policy_string():
    assert [v.label for v in plan_variants(["p=f32,c=bf16,o=f32", "fp32"], CPU)] == ["p=f32,c=bf16,o=f32", "fp32"]


def test_plan_refuses_unknown_recipe_and_modes():
    with pytest.raises(ValueError, match="Unknown recipe 'fp33'"):
        plan_variants(["fp33"], CPU)
    with pytest.raises(ValueError, match="tf32"):
        plan_variants(None, CPU, tf32_mode="maybe")
    with pytest.raises(ValueError, match="compile"):
        plan_variants(None, CPU, compile_mode="yes")


def test_make_optimizer_refuses_unknown_kind():
    with pytest.raises(ValueError, match="foreach, fused, forloop"):
        runner.make_optimizer([torch.nn.Parameter(torch.ones(1))], "lion")


@pytest.fixture(scope="module")
def tiny_doc():
    variants = [Variant("fp32"), Variant("bf16-mixed"), Variant("fp16-mixed")]
    return run_bench(SHAPES["tiny"], CPU, variants, rounds=2, warmup=1, peak_n=32)


def test_bench_json_has_one_ok_result_per_variant_with_roofline_fields(tiny_doc):
    assert tiny_doc["kind"] == "mixprec-bench"
    assert tiny_doc["flops"]["step"] == 3 * tiny_doc["flops"]["forward"]
    assert set(tiny_doc["peaks"]) == {"f32", "bf16", "f16"}
    assert tiny_doc["env"]["torch"] == torch.__version__
    for r in tiny_doc["results"]:
        assert r["status"] == "ok", r["error"]
        assert len(r["samples_s"]) == 2 and r["step_s"]["n"] == 2
        assert r["tokens_per_s"] == pytest.approx(SHAPES["tiny"].tokens / r["step_s"]["median"])
        peak = tiny_doc["peaks"][r["peak_key"]]["flops_per_s"]
        assert r["peak_fraction"] == pytest.approx(r["achieved_flops_per_s"] / peak)
        assert r["ideal_s"] == pytest.approx(tiny_doc["flops"]["step"] / peak)
        mem = r["memory"]
        assert mem["saved_bytes"] > 0 and mem["cuda_forward_delta"] is None
        # on the CPU the forward's live storages and the step's peak are counted too
        assert mem["forward_delta"] >= mem["saved_bytes"]
        assert mem["peak_step"] >= mem["persistent_bytes"] + mem["forward_delta"]
        assert r["syncs_per_step"] is None  # counted on CUDA only
        assert r["speedup_vs_fp32"]["baseline"] == "fp32"
    assert [r["peak_key"] for r in tiny_doc["results"]] == ["f32", "bf16", "f16"]
    fp32 = tiny_doc["results"][0]
    assert fp32["speedup_vs_fp32"]["median"] == 1.0
    assert tiny_doc["settings"]["rounds_run"] == 2 and tiny_doc["settings"]["budget_s"] is None


def test_bench_json_is_serialisable(tiny_doc):
    import json

    assert json.loads(json.dumps(tiny_doc))["results"][0]["label"] == "fp32"


def test_a_failing_variant_is_reported_and_the_others_still_run(monkeypatch):
    real_init = runner.Trainer.__init__

    def init(self, variant, *args, **kwargs):
        if variant.recipe == "fp16-mixed":
            raise RuntimeError("no fp16 here")
        real_init(self, variant, *args, **kwargs)

    monkeypatch.setattr(runner.Trainer, "__init__", init)
    doc = run_bench(SHAPES["tiny"], CPU, [Variant("fp32"), Variant("fp16-mixed")], rounds=1, warmup=0, peaks=False,
                    memory=False)
    by = {r["label"]: r for r in doc["results"]}
    assert by["fp16-mixed"]["status"] == "error" and "no fp16 here" in by["fp16-mixed"]["error"]
    assert by["fp32"]["status"] == "ok" and by["fp32"]["peak_fraction"] is None


def test_trainers_of_one_recipe_start_from_the_same_weights():
    batches = runner.make_batches(SHAPES["tiny"], CPU)
    a = runner.Trainer(Variant("fp32"), SHAPES["tiny"], CPU, "foreach", 1.0, batches)
    b = runner.Trainer(Variant("bf16-mixed"), SHAPES["tiny"], CPU, "foreach", 1.0, batches)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_a_time_budget_skips_late_warmups_and_cuts_the_rounds(monkeypatch):
    # each step "takes" 0.2 s: with 0.8 s, warm-ups may use 0.48 s, so two variants warm up,
    # the others are skipped, and the rounds stop at the minimum of 3 instead of 20
    import time

    real_step = runner.Trainer.step

    def slow_step(self):
        time.sleep(0.2)
        real_step(self)

    monkeypatch.setattr(runner.Trainer, "step", slow_step)
    variants = [Variant("fp32"), Variant("bf16-mixed"), Variant("fp16-mixed"), Variant("bf16-true")]
    doc = run_bench(SHAPES["tiny"], CPU, variants, rounds=20, warmup=1, peaks=False, memory=False, budget_s=0.8)
    status = {r["label"]: r["status"] for r in doc["results"]}
    assert status == {"fp32": "ok", "bf16-mixed": "ok", "fp16-mixed": "skipped", "bf16-true": "skipped"}
    assert "time budget" in doc["results"][2]["error"]
    assert doc["settings"]["rounds_run"] == 3
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert all(len(r["samples_s"]) == 3 for r in ok) and ok[1]["speedup_vs_fp32"]["n"] == 3


def test_a_budget_never_skips_the_first_two_variants():
    # compile-main's pair (fp32, bf16-mixed) must both run however long their cold compiles take
    variants = [Variant("fp32"), Variant("bf16-mixed"), Variant("fp16-mixed")]
    doc = run_bench(SHAPES["tiny"], CPU, variants, rounds=5, warmup=1, peaks=False, memory=False, budget_s=0.001)
    assert [r["status"] for r in doc["results"]] == ["ok", "ok", "skipped"]
    assert doc["settings"]["rounds_run"] == 3
