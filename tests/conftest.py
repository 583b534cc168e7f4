"""Test-wide settings.

The suite's tensors are tiny: one intra-op thread avoids OpenMP spin-waiting, which on a shared
2-core machine costs more than the parallelism gains (a 6x8 Linear's backward took ~6 ms with two
contended threads, well under 1 ms with one).
"""

import os
import tempfile

import pytest
import torch

torch.set_num_threads(1)
# auto's measurements (mixprec.autotune) go to a cache of this session, not the user's ~/.cache
os.environ.setdefault("MIXPREC_CACHE_DIR", tempfile.mkdtemp(prefix="mixprec-test-cache-"))


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global random state, whatever ran before it: a test whose
    truth depended on an unseeded draw passed or failed by the order tests ran in (and torch's
    unseeded default seed differs per process)."""
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip themselves on machines without CUDA (so ``-m cuda`` passes here)."""
    if torch.cuda.is_available():
        return

    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # the marker, not the keyword: a parameter id "cuda" is a keyword too, and a CPU test
        # parametrized over devices must not be skipped for it
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
