"""The spawned runs the distributed tests read (each once per session: starting ranks is the cost).

Each fixture runs one group of scenarios of ``workers.py`` on 2 ranks (``reshard``: 3) and hands the
tests every rank's observations. torch.distributed must have gloo (every CPU build does).
"""

import pytest
import torch.distributed as dist

from dist_helpers import spawn

if not dist.is_available():  # pragma: no cover - a torch build without torch.distributed
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)


@pytest.fixture(scope="session")
def match_run(tmp_path_factory):
    return spawn("match,compress,memory", tmp_path_factory.mktemp("dist-match"))


@pytest.fixture(scope="session")
def fault_run(tmp_path_factory):
    return spawn("skip,clip,bad", tmp_path_factory.mktemp("dist-faults"))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist-ckpt")


@pytest.fixture(scope="session")
def ckpt_run(ckpt_dir):
    return spawn("checkpoint", ckpt_dir)


@pytest.fixture(scope="session")
def reshard_run(ckpt_run, ckpt_dir, tmp_path_factory):
    return spawn("reshard", tmp_path_factory.mktemp("dist-reshard"), world=3, args=(str(ckpt_dir),))
