"""Spawning ranks for the distributed tests: N processes on this machine (gloo, a FileStore), each with
a deadline, each writing its observations as JSON.

Every process gets ``timeout`` seconds in all (the launcher kills what is left and fails the test
with the tail of each rank's output), and the process group itself a 60 s collective timeout (a
rank waiting for a peer that died raises instead of hanging).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixprec_test_env import src_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers.py"


def spawn(scenarios: str, out: Path, world: int = 2, timeout: float = 120.0, script: Path = WORKER,
          args: tuple[str, ...] = ()) -> list[dict]:
    """Run ``script scenarios out *args`` as ranks 0..world-1; return each rank's JSON (``out/rank{r}.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    store = out / "store"
    if store.exists():
        store.unlink()
    procs, logs = [], []
    for rank in range(world):
        env = src_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MIXPREC_DIST_INIT=f"file://{store}",
                   OMP_NUM_THREADS="1", PYTHONPATH=env["PYTHONPATH"] + os.pathsep + str(HERE))
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), scenarios, str(out), *args], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE)))
    deadline = time.monotonic() + timeout
    late = []
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(rank)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    tails = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{(out / f'rank{r}.log').read_text()[-2500:]}"
                      for r, p in enumerate(procs))
    if late:
        pytest.fail(f"ranks {late} did not finish within {timeout:.0f} s (killed):\n{tails}")
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"a rank failed:\n{tails}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def run_ranks(args: list[str], out: Path, world: int = 2, timeout: float = 90.0) -> list[tuple[int, str]]:
    """Run ``python *args`` as ranks 0..world-1 (as ``spawn`` does) and return each rank's (exit code,
    output), whatever they are: for the tests in which a rank is meant to die. Ranks still running
    after ``timeout`` seconds are killed and reported with exit code None."""
    out.mkdir(parents=True, exist_ok=True)
    store = out / "store"
    if store.exists():
        store.unlink()
    procs = []
    for rank in range(world):
        env = src_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MIXPREC_DIST_INIT=f"file://{store}",
                   OMP_NUM_THREADS="1", PYTHONPATH=env["PYTHONPATH"] + os.pathsep + str(HERE))
        procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=str(HERE)))
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, text))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            results.append((None, text))
    return results
