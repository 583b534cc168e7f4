"""compare on a GPU: per-step timing from CUDA events, peak memory, and healthy recipes tracking."""

from __future__ import annotations

import pytest
import torch

from mixprec.comparison.api import compare

pytestmark = pytest.mark.cuda

TINY = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 16, "batch_size": 8}


@pytest.fixture(scope="module")
def cuda_result():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return compare(steps=60, task_kwargs=TINY, device="cuda")


def test_healthy_recipes_track_on_cuda(cuda_result):
    for name, v in cuda_result.verdicts.items():
        assert v.status == "TRACKS", f"{name}: {v.message}"
    assert cuda_result.device.startswith("cuda")


def test_cuda_runs_record_peak_memory_and_event_timed_steps(cuda_result):
    for run in cuda_result.runs:
        assert run.peak_memory_bytes is not None and run.peak_memory_bytes > 0
        assert len(run.step_time_s) == run.steps and (run.step_time_s > 0).all()
    fp16 = cuda_result.run_for("fp16-mixed")
    assert fp16.scale[0] == 2.0**16
