"""HSDP: FSDP2 on a 2 x 2 mesh (replicate x shard) over 4 gloo ranks (``hsdp_workers.py``; slow: 4
processes on this machine's 2 cores)."""

import pytest

from dist_helpers import HERE, spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-hsdp")
    return spawn(str(out), out, world=4, script=HERE / "hsdp_workers.py", timeout=600)


def test_the_mesh_is_two_replicas_of_two_shards(hsdp_run):
    assert [rank["coords"] for rank in hsdp_run] == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_one_step_matches_one_process_within_the_order_of_the_four_term_sum(hsdp_run):
    for rank in hsdp_run:
        r = rank["match"]
        assert r["worst"] <= 1.0, f"an update moved {r['worst']:.2f}x its bound"
        assert r["steps"] == 1
    assert len({rank["match"]["digest"] for rank in hsdp_run}) == 1  # the same full parameters everywhere


def test_replicas_of_a_shard_stay_bitwise_equal(hsdp_run):
    for a, b in ((0, 2), (1, 3)):  # the same shard coordinate, another replica
        assert hsdp_run[a]["replicas"]["local"] == hsdp_run[b]["replicas"]["local"]
        assert hsdp_run[a]["replicas"]["optimizer"] == hsdp_run[b]["replicas"]["optimizer"]
    assert hsdp_run[0]["replicas"]["local"] != hsdp_run[1]["replicas"]["local"]  # (they are shards)
    assert {rank["replicas"]["steps"] for rank in hsdp_run} == {2}


def test_an_inf_in_one_ranks_shard_makes_all_four_skip(hsdp_run):
    for rank in hsdp_run:
        s = rank["skip"]
        assert s["first"] is False and s["hit"] is True and s["unchanged"]
        assert s["scale"] == 2.0**15
    assert len({str(rank["skip"]["state"]) for rank in hsdp_run}) == 1


def test_an_optimizer_step_that_raised_on_one_rank_is_the_same_error_on_all_four(hsdp_run):
    events = [rank["desync"]["events"] for rank in hsdp_run]
    assert events[3][1] == "RuntimeError: boom on rank 3"
    assert all(e[1] == "ok" for e in events[:3])
    assert len({e[2] for e in events}) == 1 and events[0][2].startswith("DesyncError: the ranks are out of step")
    assert "rank 3 raised after the skip decision" in events[0][2]
