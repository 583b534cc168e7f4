"""benchmarks/peers_overhead.py says what each row ran (issue 34.1 and 34.3): the optimizer's
implementation read from each arm's optimizer object (torch's CPU default AdamW is the for-loop
one, which the old rows called "foreach"), and each arm's numerics (Fabric's bf16-mixed casts the
inputs, so its residual stream runs in bf16)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("peers_overhead_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_optimizer_implementation_is_read_from_the_object(bench):
    p = [torch.nn.Parameter(torch.zeros(4))]
    assert bench.optimizer_impl(torch.optim.AdamW(p)) == "for-loop"  # torch's choice for CPU tensors
    assert bench.optimizer_impl(torch.optim.AdamW(p, foreach=True)) == "foreach"
    assert bench.optimizer_impl(torch.optim.AdamW(p, fused=True)) == "fused"
    assert bench.optimizer_impl(torch.optim.SGD(p, lr=0.1, foreach=False)) == "for-loop"


def test_a_run_records_what_each_arm_ran(bench, tmp_path, capsys):
    out = tmp_path / "peers.json"
    bench.main(["--models", "mlp", "--recipes", "bf16-mixed", "--optimizer", "for-loop", "foreach", "--threads", "1",
                "--rounds", "2", "--warmup", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "load average" in text and "[for-loop;" in text and "[foreach;" in text
    data = json.loads(out.read_text())
    assert data["env"]["load_before"] and data["env"]["load_after"]
    assert [r["optimizer"] for r in data["results"]] == ["for-loop", "foreach"]
    for r in data["results"]:
        arms = r["arms"]
        assert {a["optimizer_impl"] for a in arms.values()} == {r["optimizer"]}  # every arm ran the one named
        assert arms["hand"]["numerics"] == {"in": "f32", "residual": "-", "matmuls": "bf16", "out": "bf16"}
        assert arms["mixprec"]["numerics"] == {"in": "f32", "residual": "-", "matmuls": "bf16", "out": "f32"}
        assert arms["mixprec"]["numerics_as_hand"] and arms["mixprec"]["ran_what_was_asked"]
        if "fabric" in arms:  # Lightning Fabric's bf16-mixed casts the float inputs before the forward
            assert arms["fabric"]["numerics"]["in"] == "bf16" and not arms["fabric"]["numerics_as_hand"]
