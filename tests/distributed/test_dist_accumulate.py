"""DDP with ``accumulate=k``: one gradient all-reduce per optimizer step, not one per micro-step (2 gloo ranks).

DDP decides in the forward whether the backward all-reduces, so ``no_sync()`` around the backward
alone did nothing: every micro-step crossed the wire. The counts come from the process group's own
collective counter (``accumulate_workers.py``); the small model is one DDP bucket, so a boundary
makes two collectives: the bucket's all-reduce (16-bit storage recipes: the fp32 master gradients'
one chunk) and the skip decision.
"""

import pytest

from dist_helpers import HERE, spawn

RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")  # as accumulate_workers.RECIPES
K = 3


@pytest.fixture(scope="module")
def accumulate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-accumulate")
    return spawn(str(out), out, script=HERE / "accumulate_workers.py", timeout=300)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_window_of_k_micro_steps_makes_exactly_one_gradient_all_reduce(accumulate_run, recipe):
    for rank in accumulate_run:
        calls = rank[f"ddp/{recipe}"]["collectives"]
        assert calls == [0, 0, 2], f"collectives per mp.step call: {calls}"
        assert rank[f"ddp/{recipe}/by_hand"]["collectives"] == calls  # what a hand-written no_sync() loop makes


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_result_is_bitwise_the_hand_written_no_sync_loop(accumulate_run, recipe):
    digests = {rank[f"ddp/{recipe}"]["digest"] for rank in accumulate_run}
    assert len(digests) == 1  # every replica the same
    assert digests == {rank[f"ddp/{recipe}/by_hand"]["digest"] for rank in accumulate_run}
    assert {rank[f"ddp/{recipe}"]["steps"] for rank in accumulate_run} == {1}


def test_fsdp2_accumulates_the_same_numbers_with_one_reduce_scatter_per_window(accumulate_run):
    for rank in accumulate_run:
        got = rank["fsdp/bf16-mixed"]
        assert got["digest"] == rank["ddp/bf16-mixed"]["digest"]  # (g0 + g1) / 2 == g0 / 2 + g1 / 2, exactly
        # the micro-steps before the boundary only all-gather (the backward's re-gathers), the boundary
        # also reduce-scatters each group, then decides: more collectives, never fewer
        calls = got["collectives"]
        assert calls[0] == calls[1] and calls[2] > calls[1]
