"""``mixprec compare --nproc N`` when a rank fails: the rank's own error comes first, not after the
launcher's output (the checks made before any rank starts are in tests/test_bad_input.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from mixprec_test_env import src_env

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_when_one_rank_fails_its_error_is_the_first_thing_said():
    env = src_env()
    env["PYTHONPATH"] += ":" + str(HERE)
    out = subprocess.run([sys.executable, "-m", "mixprec", "compare", "--nproc", "2", "--task",
                          "rank_fails_task:make_task", "--task-arg", "d_model=16", "--task-arg", "n_layer=1",
                          "--steps", "2", "--recipes", "bf16-mixed", "--out", "", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    first = out.stderr.splitlines()[0]
    assert first == ("error: compare --nproc 2: rank 1 failed: OSError: rank 1 cannot read its weights: "
                     "/data/w.bin is missing"), out.stderr[-3000:]


def test_the_error_that_broke_the_collectives_comes_before_the_other_ranks_broken_collectives():
    from mixprec.comparison.parallel import _is_consequence

    failures = ["rank 0 failed: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1933",
                "rank 1 failed: OSError: rank 1 cannot read its weights"]
    assert sorted(failures, key=_is_consequence)[0].startswith("rank 1 failed: OSError")
