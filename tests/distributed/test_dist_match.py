"""2-rank DDP and FSDP2 against one process on the same global batch.

The reference trains on the same global batch as two accumulated micro-batches (rank 0's, then
rank 1's): its gradient is g0/2 + g1/2 in fp32, the ranks' is (g0 + g1)/2 (DDP: divide, then a
two-term all-reduce; FSDP2: a reduce-scatter of two terms). Halving is exact and a sum of two
terms does not depend on the order, and each rank computes exactly what one process computes on
its micro-batch (FSDP2 gathers in 16 bits exactly the parameters autocast would cast), so the
results are bitwise equal: asserted for every recipe, 3 AdamW steps. With clipping active,
FSDP2 sums the norm per shard, then over the ranks: another order, so that case is held to a
bound derived from the norm's rounding (``workers._clip_bound``).
"""

import pytest

RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")  # as workers.RECIPES


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_train_bitwise_like_one_process_on_the_same_global_batch(match_run, mode, recipe):
    delta = match_run[0]["match"]["clip/fsdp"]["delta"]  # the norm's rounding bound (see the module docstring)
    for rank in match_run:
        r = rank["match"][f"{mode}/{recipe}"]
        assert r["digest"] == r["ref_digest"], f"rank params differ from one process by up to {r['max_diff']}"
        for got, ref in zip(r["stats"], r["ref_stats"], strict=True):  # the same losses, scales and skips
            assert {k: got[k] for k in ("loss", "scale", "skipped")} == {k: ref[k] for k in ("loss", "scale", "skipped")}
            if mode == "ddp":  # the norm of the same gradients, in the same order
                assert got["grad_norm"] == ref["grad_norm"]
            else:  # summed per shard, then over the ranks (the clip at 100 was inactive either way)
                assert abs(got["grad_norm"] - ref["grad_norm"]) <= delta * ref["grad_norm"]


def test_ddp_parameters_are_identical_on_every_rank(match_run):
    for key in match_run[0]["match"]:
        if key.startswith("ddp/"):
            assert len({rank["match"][key]["local_digest"] for rank in match_run}) == 1, key


def test_fp16_recipes_use_a_loss_scale_and_bf16_ones_none(match_run):
    stats = match_run[0]["match"]
    assert {s["scale"] for s in stats["fsdp/fp16-mixed"]["stats"]} == {2.0**16}
    assert {s["scale"] for s in stats["ddp/bf16-true"]["stats"]} == {1.0}


def test_ddp_clipping_by_the_global_norm_is_bitwise_like_one_process(match_run):
    r = match_run[0]["match"]["clip/ddp"]
    assert r["ref_stats"][0]["grad_norm"] > 0.5  # the clip was active
    assert r["digest"] == r["ref_digest"]


def test_fsdp_clipping_by_the_global_norm_stays_within_the_norms_rounding(match_run):
    for rank in match_run:
        r = rank["match"]["clip/fsdp"]
        assert r["ref_stats"][0]["grad_norm"] > 0.5
        assert r["worst"] <= 1.0, f"an update moved {r['worst']:.2f}x the bound (delta {r['delta']:.2e})"
        assert abs(r["stats"][0]["grad_norm"] - r["ref_stats"][0]["grad_norm"]) <= r["delta"] * r["ref_stats"][0]["grad_norm"]


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_ddp_gradient_compression_works_on_gloo_within_the_wires_rounding(match_run, wire):
    for rank in match_run:
        r = rank["compress"][wire]
        assert r["differs"]  # the hook ran: 16-bit buckets round
        assert r["worst"] <= 1.0, f"{wire} compression moved an update {r['worst']:.2f}x its bound"
