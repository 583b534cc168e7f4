"""A step that raises on one rank, caught and carried on: never silent drift (2 gloo ranks).

``desync_workers.py`` makes one rank's step raise once (in optimizer.step, the scheduler, the
forward, the backward, between micro-steps), or one rank die or stop, and every surviving rank
catches its exception and goes on, as a user's loop does. Each cell ends in one of the outcomes
docs/distributed.md promises, never in replicas that differ unnoticed:

- the same ``DesyncError`` on every rank, and then (the replicas differ) at every step until every
  rank loads a checkpoint, after which training matches the uninterrupted run bit for bit;
- the window discarded on every rank alike (a ``DesyncError`` on the others once), and training
  going on with bitwise identical replicas and step counts;
- a rank that left the others inside a collective: every rank raises (the others when the
  process group's timeout passes), and every later step raises ``DesyncError`` (restart).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_helpers import HERE, spawn
from mixprec_test_env import src_env

SCRIPT = HERE / "desync_workers.py"
DEFAULT = ("ddp_opt", "fsdp_sched", "fsdp_opt_all", "ddp_forward", "fsdp_reset_between")
MORE = ("fsdp_opt", "ddp_sched", "ddp_opt_all", "ddp_window")
BROKEN = ("ddp_loss_hook", "ddp_mid_backward", "fsdp_loss_hook", "fsdp_mid_backward", "fsdp_forward")


@pytest.fixture(scope="module")
def desync_run(tmp_path_factory):
    out = spawn(",".join(DEFAULT), tmp_path_factory.mktemp("dist-desync"), script=SCRIPT, timeout=300)
    return {name: [rank[name] for rank in out] for name in DEFAULT}


@pytest.fixture(scope="module")
def more_run(tmp_path_factory):
    names = MORE + BROKEN + ("fsdp_mid_backward_all",)
    out = spawn(",".join(names), tmp_path_factory.mktemp("dist-desync-more"), script=SCRIPT, timeout=400)
    return {name: [rank[name] for rank in out] for name in names}


def _run(request, name):
    """The cell's ranks, from the default run or (slow) the other one: only the run asked for is spawned."""
    return request.getfixturevalue("desync_run" if name in DEFAULT else "more_run")[name]


def _at(rank, step, micro=0):
    return next(e for e in rank["events"] if (e["step"], e["micro"]) == (step, micro))


def _err(rank, step, micro=0):
    return _at(rank, step, micro).get("error", "")


def _check_sticky_then_recovered(ranks, point, mode):
    r0, r1 = ranks
    assert _err(r1, 1).startswith(f"Boom: {point} on rank 1") and _at(r0, 1).get("ok") is True
    for step in (2, 3):  # the same error on every rank, at every step, before any optimizer steps
        assert _err(r0, step).startswith("DesyncError: the ranks are out of step")
        assert _err(r0, step) == _err(r1, step)
    first = _err(r0, 2)
    assert "rank 1 raised after the skip decision" in first and f"Boom: {point} on rank 1" in first
    assert "until every rank loads the same checkpoint" in first
    for r in ranks:  # save_checkpoint refuses to write a mix of states
        assert r["saveable"].startswith("DesyncError: cannot save a checkpoint: the replicas went apart")
    # what the error was for: the two ranks are not the same any more
    assert (r0["steps"], r0["epoch"]) != (r1["steps"], r1["epoch"]) or r0["local"] != r1["local"]
    for r in ranks:  # every rank loaded the step-0 checkpoint and trained steps 1, 2: the uninterrupted run
        rec = r["recovered"]
        assert rec["stepped"] == [True, True]
        assert rec["digest"] == rec["uninterrupted"], "the recovered run is not bitwise the uninterrupted one"
        assert (rec["steps"], rec["epoch"]) == (rec["uninterrupted_steps"], rec["uninterrupted_epoch"]) == (3, 3)
    if mode == "ddp":
        assert r0["recovered"]["local"] == r1["recovered"]["local"]


def test_an_optimizer_step_that_raised_on_one_rank_is_the_same_error_on_every_rank_until_a_checkpoint(desync_run):
    _check_sticky_then_recovered(desync_run["ddp_opt"], "opt", "ddp")  # DDP, fp16-mixed


def test_a_scheduler_that_raised_on_one_rank_is_the_same_error_on_every_rank_until_a_checkpoint(desync_run):
    _check_sticky_then_recovered(desync_run["fsdp_sched"], "sched", "fsdp")  # FSDP2, fp16-mixed


@pytest.mark.slow
@pytest.mark.parametrize("name, point", [("fsdp_opt", "opt"), ("ddp_sched", "sched")])
def test_the_same_for_the_other_mode(more_run, name, point):
    _check_sticky_then_recovered(more_run[name], point, name.split("_")[0])


def _check_discarded_alike(ranks, steps, mode):
    r0, r1 = ranks
    assert r0["steps"] == r1["steps"] == steps and r0["epoch"] == r1["epoch"] == steps
    assert r0["digest"] == r1["digest"]  # the full parameters
    if mode == "ddp":  # each rank's own replica, bitwise (FSDP2: each rank holds other shards)
        assert r0["local"] == r1["local"]


@pytest.mark.parametrize("name", ["fsdp_opt_all", pytest.param("ddp_opt_all", marks=pytest.mark.slow)])
def test_every_rank_raising_at_the_same_point_discards_alike_and_training_goes_on(request, name):
    ranks = _run(request, name)
    for r, rank in enumerate(ranks):
        assert _err(rank, 1) == f"Boom: opt on rank {r}"
        assert all(e.get("ok") for e in rank["events"] if e["step"] != 1)
    _check_discarded_alike(ranks, 2, name.split("_")[0])


def test_a_forward_that_raised_on_one_ddp_rank_is_shadowed_and_the_ranks_stay_paired(desync_run):
    r0, r1 = desync_run["ddp_forward"]
    assert _err(r1, 1) == "Boom: forward on rank 1"
    assert any("the other ranks discard this step too" in n for n in _at(r1, 1)["notes"])
    assert _err(r0, 1).startswith("DesyncError: the ranks are out of step at optimizer step 2: rank 1 discarded its step")
    assert "training can go on" in _err(r0, 1)
    for r in (r0, r1):  # the same steps afterwards, paired: nothing left over at the end
        assert [e.get("ok") for e in r["events"] if e["step"] > 1] == [True, True]
    _check_discarded_alike((r0, r1), 3, "ddp")


@pytest.mark.parametrize("name", ["fsdp_reset_between", pytest.param("ddp_window", marks=pytest.mark.slow)])
def test_part_of_a_window_discarded_on_one_rank_drops_that_window_on_every_rank(request, name):
    ranks = _run(request, name)
    r0, r1 = ranks
    assert _err(r0, 1, 1).startswith("DesyncError: the ranks are out of step at optimizer step 2: rank 1 discarded "
                                     "part of its accumulation window")
    assert _err(r0, 1, 1) == _err(r1, 1, 1)
    boundaries = [[e.get("ok") for e in r["events"] if e["micro"] == 1] for r in ranks]
    assert boundaries[0] == boundaries[1] == [True, None, True, True]
    _check_discarded_alike(ranks, 3, name.split("_")[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", BROKEN)
def test_a_rank_that_raised_inside_its_communication_is_a_clear_error_on_every_rank(more_run, name):
    r0, r1 = more_run[name]
    point = name.split("_", 1)[1]
    assert _err(r1, 1) == f"Boom: {point} on rank 1"
    assert any("cannot be paired again" in n for n in _at(r1, 1)["notes"])
    # the other rank: its collective failed (timed out after the group's 4 s, or its peer closed the
    # connection on its own timeout), with the same note
    assert _err(r0, 1).startswith("RuntimeError") and "gloo" in _err(r0, 1)
    assert any("cannot be paired again" in n for n in _at(r0, 1)["notes"])
    for r in (r0, r1):  # and then the same error, at once, on every rank: nothing trains on
        later = [e for e in r["events"] if e["step"] > 1]
        assert later and all(e["error"].startswith("DesyncError: this rank's step stopped partway") for e in later)
        assert "restart the job" in later[0]["error"]
    assert r0["steps"] == r1["steps"] == 1  # no rank stepped after it
    assert r0["state_dict"].startswith("DesyncError") and r1["state_dict"].startswith("DesyncError")  # no checkpoint
    if name.startswith("ddp"):
        assert r0["local"] == r1["local"]  # the replicas still agree


@pytest.mark.slow
def test_every_rank_raising_inside_its_communication_stops_every_rank_at_once(more_run):
    for r, rank in enumerate(more_run["fsdp_mid_backward_all"]):
        assert _err(rank, 1) == f"Boom: mid_backward on rank {r}"
        assert any("cannot be paired again" in n for n in _at(rank, 1)["notes"])
        assert _err(rank, 2).startswith("DesyncError: this rank's step stopped partway")


# ---------------------------------------------------------------------------- a rank that dies or stops


def _spawn_one_dies(name: str, out: Path, timeout: float = 240.0) -> tuple[list[dict | None], list[int]]:
    """Like ``dist_helpers.spawn``, for a run in which rank 1 dies or stops: waits for rank 0, then kills
    what is left of rank 1; returns each rank's JSON (None when it wrote none) and exit code."""
    out.mkdir(parents=True, exist_ok=True)
    store = out / "store"
    procs, logs = [], []
    for rank in range(2):
        env = src_env()
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MIXPREC_DIST_INIT=f"file://{store}",
                   OMP_NUM_THREADS="1", PYTHONPATH=env["PYTHONPATH"] + os.pathsep + str(HERE))
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), name, str(out)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(HERE)))
    start = time.monotonic()
    try:
        procs[0].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    rank0_s = time.monotonic() - start
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    for log in logs:
        log.close()
    results = []
    for r in range(2):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    assert rank0_s < timeout, f"rank 0 hung:\n{(out / 'rank0.log').read_text()[-3000:]}"
    return results, [p.returncode for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize("name, how", [("ddp_uncaught", "raises, uncaught"), ("fsdp_kill", "SIGKILL"),
                                       ("ddp_stop", "SIGSTOP")])
def test_when_one_rank_dies_or_stops_the_other_ends_in_a_clear_error_not_a_hang(tmp_path, name, how):
    (r0, r1), codes = _spawn_one_dies(name, tmp_path)
    assert codes[0] == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    assert r1 is None and codes[1] != 0  # it died (or was stopped, and killed by this test)
    events = r0[name]["events"]
    bad = [i for i, e in enumerate(events) if "error" in e]
    assert bad and events[bad[0]]["step"] in (1, 2)  # (uncaught in optimizer.step: after step 1's collectives)
    first = events[bad[0]]
    assert first["error"].startswith("RuntimeError") and "gloo" in first["error"]  # the peer closed, or the timeout
    assert any("cannot be paired again" in n for n in first["notes"])
    later = events[bad[0] + 1:]
    assert later and all(e["error"].startswith("DesyncError: this rank's step stopped partway") for e in later)
