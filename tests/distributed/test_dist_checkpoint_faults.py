"""A rank SIGKILLed at each point of a save (2 gloo ranks, DDP and FSDP2): what is left loads as exactly the
previous checkpoint or the new one, never a mix and never nothing; the surviving rank raises; the next save
onto the same path works and clears what the killed one left.

Each case is one run of ``ckpt_worker.py`` (the kill point is armed in the worker, so it is
reached deterministically); the load and the next save run here, on one process. One case is in
the default suite, the matrix is slow."""

from __future__ import annotations

import json
import os

import pytest

from ckpt_state import build, state_digest, train
from dist_helpers import run_ranks
from mixprec.distributed import load_checkpoint, save_checkpoint

# (case, kill point @ rank, what the path must then load: the "old" or the "new" checkpoint)
NEXT = [  # save at step 2, then at step 4
    ("shard:before@1", "old"),   # rank 1 dies before it writes its file
    ("shard:mid@1", "old"),      # ... with its file half written
    ("shard:mid@0", "old"),
    ("shard:after@1", "old"),    # its file written, before DCP gathers the ranks' results
    ("save:written@1", "old"),   # DCP done on this rank, before the manifest
    ("save:manifest@0", "old"),  # every file written and listed, before the marker
    ("save:marker@0", "old"),    # complete, not yet renamed into place
    ("renamed@0", "old"),        # step-000004 in place, 'latest' not yet moved
    ("published@0", "new"),      # 'latest' moved: published
]
AGAIN = [  # save at step 2, then a run from scratch saves step 2 again onto the same path
    ("shard:mid@1", "old"),
    ("save:marker@0", "old"),
    ("swap:pointer-to-new@0", "new"),  # 'latest' names the new (temporary) directory
    ("swap:old-moved@0", "new"),       # the old step-000002 moved away
    ("swap:renamed@0", "new"),         # the new one renamed to step-000002, 'latest' still on its old name
    ("published@0", "new"),
]
# DDP: every point where the ranks' files differ from FSDP2's (DCP's writes), a few of rank 0's
# renames (the same file-system steps under both)
DDP = {"shard:before@1", "shard:mid@1", "shard:mid@0", "shard:after@1", "save:marker@0", "published@0",
       "swap:pointer-to-new@0", "swap:renamed@0"}
MATRIX = [(mode, case, kill, want) for mode in ("fsdp", "ddp")
          for case, cells in (("next", NEXT), ("again", AGAIN)) for kill, want in cells
          if mode == "fsdp" or kill in DDP]


def _run(tmp_path, mode, case, kill, want):
    root = tmp_path / "ckpt"
    ranks = run_ranks(["ckpt_worker.py", mode, case, str(root), kill], tmp_path / "run")
    tails = "\n".join(f"--- rank {r} (exit {code}):\n{text[-1500:]}" for r, (code, text) in enumerate(ranks))
    killed = int(kill.rsplit("@")[1])
    assert ranks[killed][0] == -9 and f"killed at {kill.split('@')[0]}" in ranks[killed][1], tails
    survivor = ranks[1 - killed]
    assert survivor[0] is not None, f"the surviving rank hung:\n{tails}"  # it raised, or (killed after) finished
    if want == "old":
        assert survivor[0] == 1 and "CheckpointError" in survivor[1], tails
    expect = json.loads((tmp_path / "ckpt.expect.json").read_text())
    mp, model, opt = build(seed=99)
    loaded = load_checkpoint(root, model=model, optimizer=opt, mp=mp)
    got = state_digest(mp, model, opt)
    assert got in (expect["old"], expect["new"]), "a mix of the two saves loaded"
    assert got == expect[want], f"loaded the {'old' if got == expect['old'] else 'new'} checkpoint ({loaded})"
    # the next save onto the same path (here, one process) works, and leaves nothing of the killed one
    train(mp, model, opt, 1, start=mp.state_dict()["steps"])
    save_checkpoint(root, model=model, optimizer=opt, mp=mp)
    left = sorted(n for n in os.listdir(root) if n.startswith("."))
    assert left == [], left
    mp2, model2, opt2 = build(seed=5)
    load_checkpoint(root, model=model2, optimizer=opt2, mp=mp2)
    assert state_digest(mp2, model2, opt2) == state_digest(mp, model, opt)


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    _run(tmp_path, "fsdp", "next", "shard:mid@1", "old")


@pytest.mark.slow
@pytest.mark.parametrize("mode, case, kill, want", MATRIX, ids=[f"{m}-{c}-{k}" for m, c, k, _ in MATRIX])
def test_a_rank_killed_at_any_point_of_a_save_leaves_one_whole_checkpoint(tmp_path, mode, case, kill, want):
    _run(tmp_path, mode, case, kill, want)


# ---------------------------------------------------------------------------- damaged, on 2 ranks

DAMAGED = [  # (case, what every rank's message says)
    ("truncated", ["step-000003 is damaged: shard __1_0.distcp is truncated (100 of", "step-000002"]),
    ("deleted", ["shard __1_0.distcp is missing"]),
    ("flipped", ["shard __1_0.distcp has changed since it was saved: its CRC-32"]),
    ("no-marker", ["latest names 'step-000003', which is not a complete checkpoint", "step-000002"]),
    ("foreign", ["is not a mixprec checkpoint"]),
    ("shape", ["does not fit this model: parameter blocks.0.fc.weight: checkpoint 128x32, model 64x32"]),
    ("save-onto-file", ["is a file: save_checkpoint(path) writes a directory of checkpoints"]),
]


@pytest.fixture(scope="module", params=["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def damage_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"damage-{request.param}")
    ranks = run_ranks(["ckpt_worker.py", request.param, "damage", str(out / "ckpt"), "none"], out / "run")
    assert all(code == 0 for code, _ in ranks), "\n".join(f"--- rank {r}:\n{t[-3000:]}" for r, (_, t) in enumerate(ranks))
    return [json.loads((out / f"ckpt.rank{r}.json").read_text()) for r in range(len(ranks))]


@pytest.mark.parametrize("case, words", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_checkpoint_is_the_same_checkpoint_error_on_every_rank_and_changes_nothing(damage_run, case,
                                                                                           words):
    messages = {rank[case]["error"] for rank in damage_run}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message is not None and message.startswith("CheckpointError: "), message
    for w in words:
        assert w in message, (w, message)
    assert all(rank[case].get("unchanged", True) for rank in damage_run)


def test_after_the_refusals_the_ranks_load_the_good_checkpoint(damage_run):
    for rank in damage_run:
        assert rank["then"].endswith("step-000003") and rank["then_digest"]
