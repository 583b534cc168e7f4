"""Defects found by probing the scale-out as a user's script would use it (2 gloo ranks, CPU).

- Stochastic rounding under DDP (``bf16-true-sr``): its generator is seeded from
  ``torch.initial_seed()``, and ranks seeded ``manual_seed(seed + rank)`` (for their dropout) drew
  other rounding bits for the same averaged update: the replicas went apart from the first step,
  silently (prepare now gives every rank rank 0's generator).
- A save whose reading back of its files raised on one rank (an OSError after DCP wrote them): that
  rank raised a bare OSError while the other waited in the manifest's all-gather, which then paired
  with the next collective of the first rank (rank 0 got rank 1's next object as a manifest and died
  in a ValueError). Now every rank raises the same CheckpointError naming the rank, and stays paired.
- Ranks that ran ``mp.prepare(model)`` without ``parallel=`` trained apart, and ``save_checkpoint``
  published rank 0's state as the 2-rank checkpoint (DCP writes a replicated tensor once). Now the
  ranks' plain tensors are compared first, and replicas that differ are refused on every rank.
"""

from __future__ import annotations

import pytest

from dist_helpers import HERE, spawn


def _run(scenario, tmp_path):
    return [r[scenario] for r in spawn(scenario, tmp_path / scenario, script=HERE / "probe_workers.py", timeout=90)]


def test_stochastic_rounding_replicas_stay_bitwise_identical_on_ranks_seeded_apart(tmp_path):
    ranks = [r["digests"] for r in _run("sr_seeded_per_rank", tmp_path)]
    assert ranks[0][0] == ranks[1][0]  # (rank 0's parameters broadcast at prepare)
    for step, (d0, d1) in enumerate(zip(*ranks)):
        assert d0 == d1, f"the replicas differ after step {step}"
    assert len(set(ranks[0])) == len(ranks[0])  # (every step changed the parameters)


def test_a_save_failing_on_one_rank_after_dcp_is_the_same_error_on_every_rank_and_they_stay_paired(tmp_path):
    results = _run("digest_fails_on_one_rank", tmp_path)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointError: saving into ")
    assert "failed on rank 1: OSError: [Errno 5] Input/output error (injected)" in errors[0]
    assert "Nothing was published" in errors[0]
    for r in results:
        assert r["latest"] == "step-000002"  # the previous checkpoint
        assert r["gathered"] == [["rank", 0], ["rank", 1]]  # the next collective pairs with the next one
        assert r["saved_after"] == "step-000003"


def test_saving_replicas_that_trained_apart_is_refused_on_every_rank_and_writes_nothing(tmp_path):
    ranks = _run("save_without_parallel", tmp_path)
    said = [r["plain"] for r in ranks]
    assert said[0] == said[1] and said[0].startswith("CheckpointError: saving into "), said
    assert "the 2 ranks hold different values of model.blocks.0" in said[0]
    assert "parallel='ddp' or 'fsdp'" in said[0] and "Nothing was written" in said[0]
    assert all("latest" not in r["plain files"] and not any(n.startswith("step-") for n in r["plain files"])
               for r in ranks)
    # the same replicas kept in step by the user's own DDP: saved as before
    assert [r["own-ddp"] for r in ranks] == ["step-000002", "step-000002"]
