"""fp8 on 2 gloo ranks: delayed scaling's amaxes reduced over the ranks (TE's reduce_amax), and DDP and
FSDP2 bitwise one process on the same global batch (issue 28.6).

Before: under DDP every rank scaled with rank 0's history (DDP broadcasts module buffers from rank 0
before each forward), and under FSDP2 the fp8 layers' weights were all-gathered in bf16 (as every
matmul weight a -mixed recipe's autocast would cast), so the fp8 cast rounded them a second time and
their gradients came back in bf16: 3e-3 from one process. Now each rank records its own amaxes, one
all-reduce (MAX) per step makes them the global batch's, and fp8 layers are gathered in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import spawn  # noqa: E402

WORKER = Path(__file__).resolve().parent / "fp8_dist_worker.py"


@pytest.fixture(scope="module")
def match_run(tmp_path_factory):
    return spawn("match", tmp_path_factory.mktemp("fp8-dist"), script=WORKER, timeout=240)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_two_ranks_train_fp8_bitwise_like_one_process(match_run, mode, recipe):
    for rank in match_run:
        got, ref = rank[f"{mode}/{recipe}"], rank[f"ref/{recipe}"]
        assert got["n_fp8"] == ref["n_fp8"] == 7
        assert got["params"] == ref["params"], f"{mode}: the parameters differ from one process's"
        assert got["fp8"] == ref["fp8"], f"{mode}: the fp8 histories or scales differ from one process's"


def test_with_reduce_amax_off_each_rank_keeps_its_own_history(match_run):
    r0, r1 = (rank["ddp/fp8-delayed/local"] for rank in match_run)
    assert r0["fp8"] != r1["fp8"]  # each rank's amaxes are its own slice's (not rank 0's, broadcast)
    assert r0["params"] == r1["params"]  # DDP averages the gradients: the replicas stay equal
    ref = match_run[0]["ref/fp8-delayed"]["step0_amax"]
    for key, row in r0["step0_amax"].items():  # step 0 (scale 1 everywhere): the global amax is the larger rank's
        other = r1["step0_amax"][key]
        assert [max(a, b) for a, b in zip(row, other)] == ref[key], key


def test_fp8_all_gather_sends_a_quarter_of_the_fp8_weights_bytes_and_trains_bitwise_the_same(match_run):
    # issue 28.7: torchao's enable_fsdp_float8_all_gather. Each rank casts its shard with the whole weight's
    # scale (the shards' amaxes all-reduced), so the gathered bits are what the layer would cast itself
    for rank in match_run:
        fp32, fp8 = rank["fsdp/fp8-current/gather8=False"], rank["fsdp/fp8-current/gather8=True"]
        assert fp8["gathered_as"] == ["Fp8ShardWeight"] and fp32["gathered_as"] == ["Tensor"]
        assert fp8["params"] == fp32["params"] == rank["ref/fp8-current"]["params"]  # bitwise one process
        saved = fp32["all_gather_bytes_per_step"] - fp8["all_gather_bytes_per_step"]
        n = fp8["fp8_weight_shard_numel"]
        # 3 bytes saved per fp8 weight element (4 -> 1), twice a step: gathered for forward, again for backward
        assert n > 0 and saved == 3 * n * 2, (saved, n)


def test_an_fp8_all_gather_run_resumes_from_a_sharded_checkpoint_bit_for_bit(match_run):
    for rank in match_run:
        assert rank["resume"]["resumed"] == rank["resume"]["straight"]
