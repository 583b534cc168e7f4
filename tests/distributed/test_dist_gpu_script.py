"""benchmarks/gpu/distributed.py: FSDP2 and DDP on a one-rank mesh against the one-process path.

On CUDA (``-m cuda``, the GPU run) with nccl; on CPU a dry run with gloo (slow: three recipes, three
paths, one launch)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec_test_env import src_env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "distributed.py"


def _run(tmp_path, device, *extra):
    out = tmp_path / "distributed.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(SCRIPT),
           "--device", device, "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=src_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_one_rank_fsdp2_and_ddp_are_bitwise_the_one_process_step_on_cpu(tmp_path):
    result = _run(tmp_path, "cpu", "--quick")
    for recipe, row in result["recipes"].items():
        assert row["fsdp"]["equal"] and row["ddp"]["equal"], (recipe, row)


@pytest.mark.cuda
def test_one_rank_fsdp2_and_ddp_are_bitwise_the_one_process_step_on_cuda(tmp_path):
    result = _run(tmp_path, "cuda", "--quick")
    for recipe, row in result["recipes"].items():
        assert row["fsdp"]["equal"] and row["ddp"]["equal"], (recipe, row)
