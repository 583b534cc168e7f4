"""MIXPREC_MASTER_WORKSPACE=keep: a bucketed step's flat temporaries kept between steps (CPU).

The same bits as allocating them afresh, on every strategy, with one bucket and with many of
different sizes, through a skipped step and an exception inside the step; the buffers really are
reused; a bad value is refused with what to set instead."""

from __future__ import annotations

import pytest
import torch
from masters_helpers import assert_bitwise_equal, setup, snapshot, train

from mixprec._env import WORKSPACE_ENV

RECIPES = ["bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def _run(recipe, mode, monkeypatch, bucket_numel=None, steps=5, poison=frozenset({2})):
    monkeypatch.setenv(WORKSPACE_ENV, mode)
    if bucket_numel is not None:
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", bucket_numel)
    model, mp, opt = setup(recipe, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
                           skip_nonfinite=True)  # the poisoned step is skipped (no recipe here scales the loss)
    monkeypatch.undo()
    stats = train(model, mp, opt, range(steps), poison=poison, max_grad_norm=0.5)
    assert [bool(s.skipped) for s in stats] == [i in poison for i in range(steps)]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # (NaN == NaN bitwise would prove nothing)
    return snapshot(model, mp, opt), mp


@pytest.mark.parametrize("bucket_numel", [None, 300])  # one bucket; many, of different sizes
@pytest.mark.parametrize("recipe", RECIPES)
def test_kept_temporaries_give_the_bits_of_fresh_ones(recipe, bucket_numel, monkeypatch):
    fresh, mp_free = _run(recipe, "free", monkeypatch, bucket_numel)
    kept, mp_keep = _run(recipe, "keep", monkeypatch, bucket_numel)
    assert not mp_free.masters._ws._bufs  # "free" keeps nothing
    assert mp_keep.masters._ws._bufs  # "keep" did keep them
    assert "MIXPREC_MASTER_WORKSPACE=keep" in mp_keep.describe() and "WORKSPACE" not in mp_free.describe()
    assert_bitwise_equal(fresh, kept)


def test_the_kept_buffers_are_reused_from_step_to_step(monkeypatch):
    monkeypatch.setenv(WORKSPACE_ENV, "keep")
    model, mp, opt = setup("bf16-true-kahan")
    train(model, mp, opt, range(2))
    ws = mp.masters._ws
    before = {k: v.data_ptr() for k, v in ws._bufs.items()}
    assert {use for use, _, _ in before} >= {"value32", "grad32", "params16"}
    train(model, mp, opt, range(2, 5))
    assert {k: v.data_ptr() for k, v in ws._bufs.items()} == before
    assert not ws.active  # only inside the bucketed step


def test_an_exception_inside_a_kept_step_leaves_the_next_steps_as_fresh_ones_would(monkeypatch):
    def run(mode):
        monkeypatch.setenv(WORKSPACE_ENV, mode)
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
        model, mp, opt = setup("bf16-true-kahan", optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True))
        monkeypatch.undo()
        assert len(mp.masters.buckets) >= 4
        train(model, mp, opt, range(2))
        calls = []

        def fail_third(o, a, k):  # the optimizer is called once per bucket: fail in the third one
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("planted")

        handle = opt.register_step_pre_hook(fail_third)
        with pytest.raises(RuntimeError, match="planted"):
            train(model, mp, opt, range(2, 3))
        handle.remove()
        assert not mp.masters._ws.active
        train(model, mp, opt, range(3, 6))
        assert len(calls) == 3 and all(torch.isfinite(p).all() for p in model.parameters())
        return snapshot(model, mp, opt)

    assert_bitwise_equal(run("free"), run("keep"))


def test_a_bad_workspace_value_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(WORKSPACE_ENV, "always")
    with pytest.raises(ValueError, match=r"MIXPREC_MASTER_WORKSPACE='always' is not one of free, keep"):
        setup("bf16-true-kahan")
