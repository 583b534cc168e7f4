"""The launcher behind ``compare --nproc``: when it kills the ranks (a timeout, Ctrl-C), every rank goes.

torchrun starts each rank in a session of its own, so killing the launcher's session killed torchrun
alone: found by qa, a ``compare(..., nproc=1000, timeout=30)`` left 182 rank processes running after
it returned (parent: init)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mixprec.distributed import launch as launcher
from mixprec_test_env import src_env

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes through /proc (Linux)")


def _alive_with(mark: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if mark in cmd and state != "Z":
                pids.append(int(entry.name))
    return pids


def _gone(mark: str, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while _alive_with(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive_with(mark)


def test_killing_the_launcher_kills_children_that_started_sessions_of_their_own():
    # the shape torchrun has: a launcher in its own session, each child in another (start_new_session=True)
    mark = f"qa-launch-{uuid.uuid4().hex}"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', " \
            f"'{mark}'], start_new_session=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", child, mark], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(_alive_with(mark)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_alive_with(mark)) == 2
        launcher._kill_session(proc)
        assert _gone(mark), f"left running: {_alive_with(mark)}"
    finally:
        for pid in _alive_with(mark):
            os.kill(pid, 9)
        proc.wait()


@pytest.mark.slow
def test_a_launch_past_its_timeout_leaves_no_rank_running():
    mark = f"qa-launch-{uuid.uuid4().hex}"
    env = src_env()
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env["PYTHONPATH"]
    started = []
    with pytest.raises(launcher.LaunchError, match="did not finish within"):
        launcher.launch("sleep_worker", [mark], 2, tag="started", on_line=started.append, timeout=25, env=env)
    try:
        assert _gone(mark), f"ranks left running: {_alive_with(mark)}"
    finally:
        for pid in _alive_with(mark):
            os.kill(pid, 9)
