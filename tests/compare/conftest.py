"""Shared, computed-once comparisons for the compare tests (each costs seconds, not minutes)."""

from __future__ import annotations

import pytest

from mixprec.comparison.api import compare

#: The built-in char GPT shrunk so that five runs take a few seconds on two busy cores.
TINY_CHARLM = {"d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16, "batch_size": 4}
TINY_STEPS = 60


@pytest.fixture(scope="session")
def healthy_comparison(tmp_path_factory):
    """The default recipes on the shrunk built-in task, with a report written."""
    out = tmp_path_factory.mktemp("compare") / "report"
    return compare(steps=TINY_STEPS, task_kwargs=TINY_CHARLM, device="cpu", out=str(out), threads=1)


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    """'mixprec compare --task' puts the working directory on sys.path, as 'python -m' would; undo it."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """These models are tiny: a second intra-op thread gains nothing and, on a busy machine, costs
    several times over (threads spin at barriers). Restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
