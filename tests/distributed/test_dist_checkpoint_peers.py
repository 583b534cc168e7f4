"""What each rank is told when a save loses a peer (2 gloo ranks, DDP).

Found by a probe: with rank 1 gone, rank 0's CheckpointError said "rank 0 stopped before saying it was
done" (itself); and a rank that raised inside save_checkpoint before the first collective got a bare
RuntimeError while the other waited in the collective until the timeout.
"""

from __future__ import annotations

import re

from dist_helpers import run_ranks


def _said(text: str, rank: int) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(f"rank {rank}: ")]
    return "\n".join(lines)


def test_rank0_names_the_rank_that_stopped_not_itself(tmp_path):
    ranks = run_ranks(["ckpt_peer_worker.py", "die", str(tmp_path / "ckpt")], tmp_path / "run", timeout=120)
    (code0, text0), (code1, _) = ranks
    assert code1 == 3 and code0 == 0, text0[-2000:]
    said = _said(text0, 0)
    assert said.startswith("rank 0: CheckpointError: ") and "another rank (rank 1) stopped" in said, said
    assert "rank 0 stopped" not in said


def test_a_rank_raising_before_the_first_collective_is_the_same_checkpoint_error_on_every_rank(tmp_path):
    ranks = run_ranks(["ckpt_peer_worker.py", "raise", str(tmp_path / "ckpt")], tmp_path / "run", timeout=120)
    said = [_said(text, r) for r, (_, text) in enumerate(ranks)]
    assert all(code == 0 for code, _ in ranks), "\n".join(t[-1500:] for _, t in ranks)
    first = [s.splitlines()[0] for s in said]
    for r, line in enumerate(first):
        assert re.match(rf"rank {r}: CheckpointError: saving into .*ckpt failed before anything was written \(rank 1: "
                        r"RuntimeError: injected: building the state failed on rank 1\)\. Nothing was written", line), line
    assert first[0].split(": ", 1)[1] == first[1].split(": ", 1)[1]  # the same words on every rank
    assert all(s.splitlines()[1].endswith("saved after the refused save") for s in said)  # still paired


def test_one_rank_with_a_bad_argument_raises_the_same_checkpoint_error_on_every_rank(tmp_path):
    ranks = run_ranks(["ckpt_peer_worker.py", "badarg", str(tmp_path / "ckpt")], tmp_path / "run", timeout=120)
    assert all(code == 0 for code, _ in ranks), "\n".join(t[-1500:] for _, t in ranks)
    lines = [_said(text, r).splitlines() for r, (_, text) in enumerate(ranks)]
    for r, said in enumerate(lines):
        save, load, after = said
        assert save.startswith(f"rank {r}: save: CheckpointError: saving into ") and "refused on rank 1 " in save, save
        assert "rank 1: ValueError: keep must be a positive integer" in save and "Nothing was written" in save, save
        assert load.startswith(f"rank {r}: load: CheckpointError: loading ") and "refused on rank 1 " in load, load
        assert "rank 1: TypeError: checksums must be True" in load and "Nothing was loaded" in load, load
        assert after.endswith("saved after the refused calls")
    assert lines[0][0].split(": ", 2)[2] == lines[1][0].split(": ", 2)[2]  # the same words on every rank


def test_ranks_given_different_paths_are_refused_on_every_rank(tmp_path):
    ranks = run_ranks(["ckpt_peer_worker.py", "paths", str(tmp_path / "ckpt")], tmp_path / "run", timeout=120)
    assert all(code == 0 for code, _ in ranks), "\n".join(t[-1500:] for _, t in ranks)
    for r, (_, text) in enumerate(ranks):
        save, load, _after = _said(text, r).splitlines()
        assert "CheckpointError: saving into a checkpoint: the ranks were given different paths" in save, save
        assert "rank0" in save and "rank1" in save and "pass the same path on every rank" in save, save
        assert "CheckpointError: loading a checkpoint: the ranks were given different paths" in load, load
    assert not (tmp_path / "ckpt" / "rank0").exists() and not (tmp_path / "ckpt" / "rank1").exists()
