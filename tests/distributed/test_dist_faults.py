"""One skip decision for every rank, the global clip, and bad input refused on every rank (2 ranks).

The inf goes into rank 1's own shard of ``head.weight``'s gradient after the reduce-scatter
(FSDP2), so only rank 1's local check would see it; under DDP into rank 1's loss, which the
all-reduce spreads."""

import math

import pytest


def test_an_inf_in_one_ranks_shard_makes_every_rank_skip_and_halve_the_scale_once(fault_run):
    for rank in fault_run:
        s = rank["skip"]
        assert s["fsdp_clean"]["skipped"] is False
        assert s["fsdp_inf"]["skipped"] is True
        assert s["fsdp_inf"]["scale"] == 2.0**16 and s["fsdp_scale_after"] == 2.0**15
        assert s["fsdp_unchanged"]  # this rank's parameter shards and optimizer state, bitwise
        assert s["fsdp_next"]["skipped"] is False and s["fsdp_next"]["scale"] == 2.0**15
    assert fault_run[0]["skip"]["fsdp_scaler_state"] == fault_run[1]["skip"]["fsdp_scaler_state"]
    assert fault_run[0]["skip"]["fsdp_digest"] == fault_run[1]["skip"]["fsdp_digest"]


def test_an_inf_in_one_ranks_loss_under_ddp_skips_every_rank(fault_run):
    for rank in fault_run:
        s = rank["skip"]
        assert s["ddp_inf"]["skipped"] is True and s["ddp_scale_after"] == 2.0**15 and s["ddp_unchanged"]
    assert fault_run[0]["skip"]["ddp_digest"] == fault_run[1]["skip"]["ddp_digest"]


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_an_inf_in_one_ranks_gradient_of_a_parameter_beside_the_model_skips_every_rank(fault_run, mode):
    for rank in fault_run:  # only mixprec's MAX all-reduce of the flag reaches rank 0 here
        s = rank["skip"]
        assert s[f"{mode}_extra"]["skipped"] is True, f"rank skipped={s[f'{mode}_extra']['skipped']}"
        assert s[f"{mode}_extra_unchanged"] and s[f"{mode}_extra_scale_after"] == 2.0**15


@pytest.mark.parametrize("case", ["hysteresis", "floor"])
def test_hysteresis_and_the_floor_behave_on_two_ranks_as_on_one_process(fault_run, case):
    one = fault_run[0]["skip"][case]["one"]
    decisions = [(s["skipped"], s["scale"], s["scale_after"], s["state"]) for s in one]
    for rank in fault_run:
        got = rank["skip"][case]["fsdp"]
        assert [(s["skipped"], s["scale"], s["scale_after"], s["state"]) for s in got] == decisions
    if case == "hysteresis":  # 2 overflows before the first halving
        assert [s[2] for s in decisions] == [2.0**16, 2.0**16, 2.0**15, 2.0**14, 2.0**14]
    else:  # the floor holds
        assert [s[2] for s in decisions] == [2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**15]


def test_a_large_gradient_in_one_shard_clips_every_rank_by_the_same_global_norm(fault_run):
    norms = [rank["clip"]["large"]["norm"] for rank in fault_run]
    assert norms[0] == norms[1]
    total = math.sqrt(sum(rank["clip"]["large"]["local_sq"] for rank in fault_run))
    assert norms[0] == pytest.approx(total, rel=1e-6)
    for rank in fault_run:  # rank 0's shards are small, and still clipped by the global coefficient
        assert rank["clip"]["large"]["ratio"] == pytest.approx(1.0 / (norms[0] + 1e-6), rel=1e-5)


def test_a_nan_in_one_shard_is_the_norm_of_every_rank(fault_run):
    for rank in fault_run:
        assert math.isnan(rank["clip"]["nan"]["norm"]) and math.isnan(rank["clip"]["nan"]["ratio"])
        assert rank["clip"]["nan"]["norm_is_tensor"] == "Tensor"  # a plain tensor, not a DTensor


@pytest.mark.parametrize("case, words", [
    ("recipes_differ", ["ranks disagree on the recipe", "rank 0: bf16-mixed", "rank 1: fp16-mixed"]),
    ("wrapped", ["already wrapped in DistributedDataParallel", "model.module", "Ranks 0, 1"]),
    ("kahan_fsdp", ["bf16-true-kahan", "Use 'bf16-true'", "parallel='ddp'"]),
    ("pure_fsdp", ["fp16-pure", "bf16-true"]),
    ("compress_true", ["compress", "fp32 master gradients", "drop compress"]),
    ("one_rank_prepared", ["Rank 1:", "already prepared"]),
    ("units_typo", ["'blockz' matches no submodule"]),
])
def test_bad_input_is_the_same_clear_error_on_every_rank(fault_run, case, words):
    messages = [rank["bad"][case] for rank in fault_run]
    assert messages[0] is not None and messages[0] == messages[1]
    assert messages[0].startswith("ParallelError")
    for w in words:
        assert w in messages[0], (w, messages[0])


def test_after_refused_setups_the_ranks_still_agree_and_train(fault_run):
    assert fault_run[0]["bad"]["then_trains"] == fault_run[1]["bad"]["then_trains"]
    assert fault_run[0]["bad"]["then_trains"][0]["skipped"] is False
